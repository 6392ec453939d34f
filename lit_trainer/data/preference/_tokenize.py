"""The functions ``PreferenceDataModule`` maps over its rows: text pairs tokenized, pairs with images measured.

They are module-level functions given their options as ``Dataset.map``'s ``fn_kwargs``, never closures over the data
module: ``datasets`` pickles the mapped function and its arguments for the cache fingerprint, and during ``fit`` the
data module's ``trainer`` points at the model, so a closure over it pickled the whole model at every ``map`` (issue
48). Pickled by name, with the tokenizer (or processor) and a few options, the fingerprint is a few kB and the same in
every process, so ``datasets``' cache of a file's tokenized rows is reused.
"""

from __future__ import annotations

from typing import Any

from lit_trainer.data.chat import render, require_chat_template, template_options
from lit_trainer.data.collate import common_prefix_len
from lit_trainer.data.preference.collate import TruncationMode, end_with_eos, same_model_inputs
from lit_trainer.data.vision.images import row_images
from lit_trainer.data.vision.preference import VisionPreferenceCollator
from lit_trainer.data.vision.rows import ROW_KEY

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def extract_prompt(chosen: str | list, rejected: str | list) -> tuple[str | list, str | list, str | list]:
    """Split an implicit prompt off a pair: ``(prompt, chosen, rejected)`` (reference 1.2 step 1).

    Walks ``min(len)`` elements (characters or messages) to the first mismatch ``i``; when ``chosen[i-1]`` is a space
    the split moves one left, so the space goes to the completions. When nothing differs, ``i`` stops at the last
    compared element, which stays in the completions (as TRL: no completion is left empty). Fixed from TRL: a
    mismatch at ``i = 0`` does not look at ``chosen[-1]``.

    Example:
        >>> extract_prompt("The sky is blue", "The sky is green")
        ('The sky is', ' blue', ' green')
    """
    i = 0
    for i in range(min(len(chosen), len(rejected))):
        if chosen[i] != rejected[i]:
            if i > 0 and chosen[i - 1] == " ":
                i -= 1
            break
    return chosen[:i], chosen[i:], rejected[i:]


def _normalise(row: dict[str, Any], explicit: bool) -> tuple[Any, Any, Any, bool]:
    """``(prompt, chosen, rejected, is_conversation)`` of a checked row, with the prompt made explicit."""
    is_chat = isinstance(row["chosen"], list)
    if explicit:
        return row["prompt"], row["chosen"], row["rejected"], is_chat
    return (*extract_prompt(row["chosen"], row["rejected"]), is_chat)


def _encode_text(tok: Any, prompt: str, chosen: str, rejected: str) -> list[list[int]]:
    chosen, rejected = end_with_eos(chosen, tok.eos_token), end_with_eos(rejected, tok.eos_token)
    return tok([prompt, prompt + chosen, prompt + rejected])["input_ids"]  # one call: ~3x faster than three


def _encode_chat(tok: Any, row: dict[str, Any], prompt: list, chosen: list, rejected: list) -> list[list[int]]:
    options = template_options(row)
    require_chat_template(tok, "The preference data")
    return [
        render(tok, prompt, add_generation_prompt=True, **options),
        render(tok, prompt + chosen, **options),
        render(tok, prompt + rejected, **options),
    ]


def tokenize_pairs(
    batch: dict[str, list], *, tokenizer: Any, explicit: bool, max_length: int, truncation_mode: TruncationMode
) -> dict[str, list]:
    """A batch of text pairs tokenized: ``prompt_ids``/``chosen_ids``/``rejected_ids`` split at the common prefix of
    the prompt and both rows, ``length`` (the longer row, at most ``max_length``), ``truncated`` and ``identical``
    (the same model inputs once truncated); ``explicit``: the rows have a ``prompt`` column."""
    out: dict[str, list] = {name: [] for name in (*TOKEN_COLUMNS, "length", "truncated", "identical")}
    for i in range(len(batch["chosen"])):
        row = {key: values[i] for key, values in batch.items()}
        prompt, chosen, rejected, is_chat = _normalise(row, explicit)
        encode = (
            _encode_chat(tokenizer, row, prompt, chosen, rejected)
            if is_chat
            else _encode_text(tokenizer, prompt, chosen, rejected)
        )
        prompt_ids, pc, pr = encode
        cut = min(common_prefix_len(prompt_ids, pc), common_prefix_len(prompt_ids, pr))
        longest = cut + max(len(pc) - cut, len(pr) - cut)
        for name, value in zip(TOKEN_COLUMNS, (prompt_ids[:cut], pc[cut:], pr[cut:])):
            out[name].append(value)
        out["length"].append(min(longest, max_length))
        out["truncated"].append(longest > max_length)
        out["identical"].append(same_model_inputs(prompt_ids[:cut], pc[cut:], pr[cut:], max_length, truncation_mode))
    return out


def measure_image_pair(
    row: dict[str, Any], index: int, *, collator: VisionPreferenceCollator, per_image: int
) -> dict[str, Any]:
    """``row`` (index), ``length``, ``prompt_tokens``, ``truncated`` and ``identical`` of a pair with images, estimated
    from its rendered texts without decoding an image: each image placeholder counts as the ``per_image`` tokens it
    expands to. ``collator`` renders the texts (its processor, image column, ``max_length`` and split)."""
    index = row.get(ROW_KEY, index)  # the index in the dataset as given (before the validation split)
    count = len(row_images(row, collator.image_column))
    prompt, chosen, rejected = collator.texts(row, [None] * count, f"row {index} of the {collator.split} data")
    tok, limit = collator.processor.tokenizer, collator.max_length
    prompt_ids, chosen_ids, rejected_ids = tok([prompt, chosen, rejected], add_special_tokens=False)["input_ids"]
    prompt_tokens = len(prompt_ids) + count * (per_image - 1)
    longest = prompt_tokens + max(len(chosen_ids), len(rejected_ids))
    same = same_model_inputs([0] * prompt_tokens, chosen_ids, rejected_ids, limit, "keep_start")
    return {ROW_KEY: index, "length": min(longest, limit), "prompt_tokens": prompt_tokens,
            "truncated": longest > limit, "identical": same}  # fmt: skip
