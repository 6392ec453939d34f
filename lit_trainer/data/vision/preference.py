"""Preference pairs with images, processed when the batch is built (TRL 1.16's ``DataCollatorForVisionPreference``).

A micro-batch of B pairs becomes the batch the DPO module reads from text pairs
(:class:`~lit_trainer.data.preference.collate.PreferenceCollator`): 2B right-padded rows, chosen rows ``0..B-1`` then
rejected rows ``B..2B-1``, with ``input_ids``, ``attention_mask`` and the unshifted ``completion_mask``, plus the image
inputs of the processor (``pixel_values``, ...) for those 2B rows in the same order: each pair's images appear twice,
once for its chosen row and once for its rejected row, so both rows (and the reference model's forward) see them.

Each pair is processed on its own, so an error names its row: the prompt (which holds every image of the pair, TRL's
rule) goes through the processor with the images, each completion through it as text, and the row is
``prompt + completion``. Image tokens are never in the completion mask.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lit_trainer.data.chat import template_options
from lit_trainer.data.preference.collate import end_with_eos
from lit_trainer.data.vision.collate import Encoded, RowCollator, process, split_row, stack, truncate
from lit_trainer.data.vision.images import load_image, row_images
from lit_trainer.data.vision.messages import with_images
from lit_trainer.losses.logprobs import IGNORE_INDEX


def common_prefix(*texts: str) -> str:
    """The longest string every one of ``texts`` starts with.

    Example:
        >>> common_prefix("<|user|>hi<|assistant|>", "<|user|>hi<|assistant|>4</s>", "<|user|>hi<|assistant|>5</s>")
        '<|user|>hi<|assistant|>'
    """
    first = texts[0]
    end = len(first)
    for text in texts[1:]:
        end = min(end, len(text))
        for i in range(end):
            if text[i] != first[i]:
                end = i
                break
    return first[:end]


@dataclass
class VisionPreferenceCollator(RowCollator):
    """DPO batches of preference pairs with images, processed when the batch is built.

    Row formats (decided per row, as for text pairs): conversational (``prompt``, ``chosen`` and ``rejected`` are
    message lists whose contents are strings or lists of ``{"type": "image"}`` / ``{"type": "text"}`` parts; string
    contents get the images at the start of the prompt's first user turn, TRL's rule) or strings (the prompt holds the
    processor's image token once per image; each completion ends with the EOS, as text pairs do). The completions
    are the text after the longest common prefix of the rendered prompt, prompt + chosen and prompt + rejected (TRL's
    rule). Each of the 2B rows keeps its first ``max_length`` tokens; a cut that would drop image tokens is refused.

    Args:
        processor: the vision-language model's processor.
        image_column: ``"images"`` (a list per row) or ``"image"`` (one per row), or None.
        max_length: per-row token budget, applied to each of the 2B rows.
        split: named in errors.
        place: where a row is in its source, named in errors (default: its ``_row`` index and ``split``).
        pad_to_multiple_of: round the padded length up.
    """

    processor: Any
    image_column: str | None
    max_length: int
    split: str = "train"
    pad_to_multiple_of: int | None = None
    place: Callable[[Mapping[str, Any]], str] | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        pairs = [self.encode(row) for row in rows]
        encoded = [chosen for chosen, _ in pairs] + [rejected for _, rejected in pairs]
        batch = stack(encoded, self.pad_token_id, self.pad_to_multiple_of)
        batch["completion_mask"] = (batch.pop("labels") != IGNORE_INDEX).long()
        return batch

    def texts(self, row: Mapping[str, Any], images: list[Any], where: str) -> tuple[str, str, str]:
        """``(prompt, chosen, rejected)`` texts of a row: the prompt with the image tokens, the completions after it."""
        if not isinstance(row["chosen"], str):
            render = self.processor.apply_chat_template
            options = template_options(row)
            prompt_turns = with_images(row["prompt"], images, where)
            prompt = render(prompt_turns, tokenize=False, add_generation_prompt=True, **options)
            answers = [with_images(row[side], [], f"{where}, column {side!r}") for side in ("chosen", "rejected")]
            full = [render(prompt_turns + answer, tokenize=False, **options) for answer in answers]
            prompt = common_prefix(prompt, *full)
            return prompt, full[0][len(prompt) :], full[1][len(prompt) :]
        eos = self.processor.tokenizer.eos_token
        return row["prompt"], end_with_eos(row["chosen"], eos), end_with_eos(row["rejected"], eos)

    def encode(self, row: Mapping[str, Any]) -> tuple[Encoded, Encoded]:
        """The chosen and rejected rows of one pair, both with the pair's image inputs, truncated."""
        where = self.where(row)
        images = [load_image(value, where) for value in row_images(row, self.image_column)]
        prompt, chosen, rejected = self.texts(row, images, where)
        prompt_ids, image_inputs, prompt_per_token = split_row(process(self.processor, prompt, images, where))
        rows = []
        for completion in (chosen, rejected):
            ids, _, per_token = split_row(process(self.processor, completion, [], where))
            enc = Encoded(
                prompt_ids + ids,
                [0] * len(prompt_ids) + [0 if t in self.image_ids else 1 for t in ids],
                len(prompt_ids),
                dict(image_inputs),
                {k: v + per_token.get(k, [0] * len(ids)) for k, v in prompt_per_token.items()},
            )
            truncate(enc, self.max_length, self.image_ids, where)
            rows.append(enc)
        return rows[0], rows[1]
