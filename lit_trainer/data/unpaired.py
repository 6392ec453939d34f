"""UnpairedPreferenceDataModule: prompt/completion/label rows for KTO, preprocessed and collated as TRL 1.16's
``KTOTrainer``.

Rows are TRL's unpaired preference format, ``{"prompt", "completion", "label"}`` with a bool label (True = desirable,
a thumbs-up; False = undesirable, a thumbs-down), standard (strings) or conversational (lists of ``{"role",
"content"}`` messages, rendered with the tokenizer's chat template; optional ``tools`` / ``chat_template_kwargs``
columns are forwarded). Paired preference data (``chosen``/``rejected``, with or without an explicit ``prompt``) is
unpaired as TRL's ``unpair_preference_dataset`` does: every pair gives a ``(prompt, chosen, True)`` row and a
``(prompt, rejected, False)`` row. ``builtin:addition`` is the addition task's pairs unpaired: the correct sum is
desirable, a near miss undesirable.

Preprocessing (as TRL): standard completions get the tokenizer's EOS string appended; ``prompt_ids = tok(prompt)`` and
``tok(prompt + completion)`` are split at their common prefix; rows whose prompt alone reaches ``max_length`` are
dropped (counted in ``stats["<split>_rows_dropped_prompt_too_long"]``), longer rows keep their first ``max_length``
tokens (``<split>_rows_truncated``).

Mismatched pairs for the KL estimate are a property of the row, fixed at preprocessing exactly as TRL: every split's
rows, in dataset order (after the drops above), are cut into consecutive chunks of ``batch_size`` rows (the per-device
TRAIN micro-batch size, for the validation split too, as TRL) and the completions are rotated by one inside each chunk:
``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``, stored as a ``KL_completion_ids`` column. With sequential sampling a
micro-batch is a chunk, so its mismatched rows are TRL's; with any other sampling every row still carries its own
mismatched partner. One deliberate fix: a last chunk of a single row (TRL pairs it with its own completion, i.e. not
mismatched) takes the completion of the row before it. Because the partner is fixed per row, the reference log-probs
of a row and of its partner can be precomputed once (``ref_logps`` / ``ref_KL_logps`` columns, TRL's names; see
:class:`~lit_trainer.modules.kto.KTOModule`'s ``precompute_ref_log_probs``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar

import torch
from datasets import Dataset
from typing_extensions import override

from lit_trainer.data import builtin, vision
from lit_trainer.data.base import BaseDataModule, BuiltinSources
from lit_trainer.data.chat import render, require_chat_template, template_options
from lit_trainer.data.collate import common_prefix_len, pad_right
from lit_trainer.data.loader import EvalLoader
from lit_trainer.data.preference import end_with_eos, extract_prompt
from lit_trainer.data.preference._checks import RowProblem, check_row, value_problem
from lit_trainer.data.reference_columns import ReferenceColumns
from lit_trainer.data.sources import Locator, describe_columns, locate_problem

__all__ = [
    "KL_COMPLETION_KEY",
    "KL_PREFIX",
    "REF_KEY",
    "REF_KL_KEY",
    "UnpairedCollator",
    "UnpairedPreferenceDataModule",
    "addition_unpaired_rows",
    "kl_partner_completions",
    "unpair_rows",
]

KL_PREFIX = "KL_"  # the mismatched rows' tensors: KL_input_ids, KL_attention_mask, KL_completion_mask (as TRL)
KL_COMPLETION_KEY = "KL_completion_ids"  # each row's mismatched completion (its KL partner), fixed at preprocessing
REF_KEY, REF_KL_KEY = "ref_logps", "ref_KL_logps"  # precomputed reference log-probs of the row and of its partner
TOKEN_COLUMNS = ("prompt_ids", "completion_ids", KL_COMPLETION_KEY)  # what the reference log-probs depend on
_DOUBLE_EOS_WARNING = r"This sequence already has"


def kl_partner_completions(completions: list[list[int]], chunk: int) -> list[list[int]]:
    """Each row's mismatched completion: the completions rotated by one inside consecutive chunks of ``chunk`` rows
    (TRL 1.16's KL dataset), ``[y_n, y_1, ..., y_{n-1}]`` per chunk. A last chunk of ONE row takes the completion of
    the row before it (TRL would give it its own completion, which is no mismatched pair).

    Example:
        >>> kl_partner_completions([[1], [2], [3], [4], [5]], 2)
        [[2], [1], [4], [3], [4]]
    """
    if chunk < 1:
        raise ValueError(f"`chunk={chunk}` is invalid: use an integer >= 1.")
    out: list[list[int]] = []
    for start in range(0, len(completions), chunk):
        part = completions[start : start + chunk]
        out.extend(part[-1:] + part[:-1] if len(part) > 1 or start == 0 else completions[start - 1 : start])
    return out


def unpair_rows(rows: Dataset) -> Dataset:
    """Paired ``prompt?/chosen/rejected`` rows as unpaired ``prompt/completion/label`` rows, as TRL's
    ``unpair_preference_dataset``: per block of 1,000 pairs (``datasets``' default map batch), the chosen rows (label
    True) then the rejected rows (label False), in pair order; an implicit prompt is split off as the common prefix
    first. Other columns (e.g. ``answer``) are repeated."""
    explicit = "prompt" in rows.column_names
    extra = [c for c in rows.column_names if c not in ("prompt", "chosen", "rejected")]

    def unpair(batch: dict[str, list]) -> dict[str, list]:
        pairs = []
        for i in range(len(batch["chosen"])):
            chosen, rejected = batch["chosen"][i], batch["rejected"][i]
            prompt, chosen, rejected = (
                (batch["prompt"][i], chosen, rejected) if explicit else extract_prompt(chosen, rejected)
            )
            pairs.append((prompt, chosen, rejected))
        out = {
            "prompt": [p for p, _, _ in pairs] * 2,
            "completion": [c for _, c, _ in pairs] + [r for _, _, r in pairs],
            "label": [True] * len(pairs) + [False] * len(pairs),
        }
        out.update({column: batch[column] * 2 for column in extra})
        return out

    return rows.map(unpair, batched=True, batch_size=1000, remove_columns=rows.column_names, desc="Unpairing")


def addition_unpaired_rows(split: builtin.Split, num_validation: int = 500) -> Dataset:
    """Thumbs-up/down rows of the addition task: the correct sum (True) and a near miss (False) of every problem."""
    return unpair_rows(builtin.preference_rows(split, num_validation))


def _encode(tok: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)``: prompt and prompt+completion tokenized, split at their common prefix."""
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(completion, list):
        require_chat_template(tok, "The unpaired preference data")
        options = template_options(row)
        prompt_ids = render(tok, prompt, add_generation_prompt=True, **options)
        full = render(tok, prompt + completion, **options)
    else:
        prompt_ids, full = tok([prompt, prompt + end_with_eos(completion, tok.eos_token)])["input_ids"]
    cut = common_prefix_len(prompt_ids, full)
    return prompt_ids[:cut], full[cut:]


def tokenize_unpaired(batch: dict[str, list], *, tokenizer: Any) -> dict[str, list]:
    """A batch of unpaired rows tokenized: ``prompt_ids``, ``completion_ids``, ``label``, ``length`` (uncapped).

    Module-level and given the tokenizer as ``fn_kwargs``: ``datasets`` pickles the mapped function for its cache
    fingerprint, and a method of the data module pickled the module with its trainer and model (issue 48)."""
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "label": [], "length": []}
    for i in range(len(batch["completion"])):
        prompt_ids, completion_ids = _encode(tokenizer, {key: values[i] for key, values in batch.items()})
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(completion_ids)
        out["label"].append(bool(batch["label"][i]))
        out["length"].append(len(prompt_ids) + len(completion_ids))
    return out


def _label_problem(value: Any) -> str | None:
    if not isinstance(value, bool):
        got = f"{type(value).__name__} {value!r:.40}"
        return f"expected a bool label (True = desirable, False = undesirable), got {got}"
    return None


class UnpairedCollator:
    """Collate unpaired rows into right-padded ``input_ids``/``attention_mask``/``completion_mask`` (B rows), a bool
    ``label`` (B,), and the mismatched rows ``KL_input_ids``/``KL_attention_mask``/``KL_completion_mask``: row ``i``'s
    prompt with its ``KL_completion_ids`` (its partner, fixed at preprocessing; rows without that key, e.g. hand-made
    ones, take row ``i-1``'s completion, row 0 the last row's). Precomputed ``ref_logps``/``ref_KL_logps`` are passed
    on as float32 (B,) tensors when every row has them. Every row keeps its first ``max_length`` tokens.

    Args:
        pad_token_id: id used for padding ``input_ids`` (masked out by ``attention_mask``).
        max_length: per-row token budget.
        pad_to_multiple_of: round the padded length up.
        mismatched: build the ``KL_*`` rows (the ``kto`` loss needs them; ``apo_zero_unpaired`` does not).

    Example:
        >>> batch = UnpairedCollator(0, 8)([{"prompt_ids": [5], "completion_ids": [6], "label": True},
        ...                                 {"prompt_ids": [7], "completion_ids": [8, 9], "label": False}])
        >>> batch["KL_input_ids"].tolist()
        [[5, 8, 9], [7, 6, 0]]
    """

    def __init__(
        self, pad_token_id: int, max_length: int, pad_to_multiple_of: int | None = None, mismatched: bool = True
    ) -> None:
        self.pad_token_id, self.max_length = pad_token_id, max_length
        self.pad_to_multiple_of, self.mismatched = pad_to_multiple_of, mismatched

    def _rows(self, prompts: list[list[int]], completions: list[list[int]], prefix: str) -> dict[str, torch.Tensor]:
        ids = [(p + c)[: self.max_length] for p, c in zip(prompts, completions)]
        masks = [([0] * len(p) + [1] * len(c))[: self.max_length] for p, c in zip(prompts, completions)]
        multiple = self.pad_to_multiple_of
        return {
            f"{prefix}input_ids": pad_right(ids, self.pad_token_id, multiple),
            f"{prefix}attention_mask": pad_right([[1] * len(s) for s in ids], 0, multiple),
            f"{prefix}completion_mask": pad_right(masks, 0, multiple),
        }

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        prompts = [row["prompt_ids"] for row in rows]
        completions = [row["completion_ids"] for row in rows]
        batch = self._rows(prompts, completions, "")
        if self.mismatched:
            if all(KL_COMPLETION_KEY in row for row in rows):
                partners = [row[KL_COMPLETION_KEY] for row in rows]
            else:
                partners = completions[-1:] + completions[:-1]
            batch.update(self._rows(prompts, partners, KL_PREFIX))
        batch["label"] = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool)
        for key in (REF_KEY, REF_KL_KEY):
            if all(key in row for row in rows):
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch

    def reference_rows(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The B rows and their B partners as ONE batch of 2B rows (rows first): what the precompute pass scores."""
        prompts = [row["prompt_ids"] for row in rows]
        partners = [row[KL_COMPLETION_KEY] for row in rows]
        return self._rows(prompts * 2, [row["completion_ids"] for row in rows] + partners, "")


class UnpairedPreferenceDataModule(ReferenceColumns, BaseDataModule):
    """Unpaired preference rows (prompt, completion, bool label) for :class:`~lit_trainer.modules.kto.KTOModule`,
    with TRL 1.16's preprocessing; paired data is unpaired (see the module docstring).

    ``count_items`` is the number of examples of a micro-batch: KTO's loss is a mean over examples, so the step's
    global example count is the token-exact normaliser. The ``length`` column holds each row's prompt+completion
    token count (capped at ``max_length``), for the length-aware samplers.

    Args:
        pad_to_multiple_of: round padded lengths up to a multiple.
        mismatched_pairs: build the ``KL_*`` rows of the KL estimate (default True; ``KTOModule`` with
            ``loss_type="apo_zero_unpaired"`` does not read them, False saves the collation).
        **kwargs: the options of :class:`~lit_trainer.data.base.BaseDataModule` (``tokenizer``, ``dataset``,
            ``max_length``, ``batch_size``, ``sampling``, DataLoader options, ...).

    Raises:
        ValueError: at setup: missing columns, a malformed row (its file and line, or index, and its column are named;
            labels must be bools), conversational rows without a chat template, or no row left after filtering.

    Example::

        dm = UnpairedPreferenceDataModule(tokenizer="tiny", dataset="builtin:addition", batch_size=64, max_length=32)
        trainer.fit(KTOModule("tiny"), datamodule=dm)
    """

    REFERENCE_COLUMNS = (REF_KEY, REF_KL_KEY)  # per row: the row's reference log-prob and its KL partner's
    TOKEN_COLUMNS = TOKEN_COLUMNS
    FINGERPRINT_TAG = "kto|"
    builtin: ClassVar[BuiltinSources] = {"builtin:addition": addition_unpaired_rows}

    def __init__(
        self, *args: Any, pad_to_multiple_of: int | None = None, mismatched_pairs: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"`pad_to_multiple_of={pad_to_multiple_of}` is invalid: use an integer >= 1 or None.")
        self.save_hyperparameters(ignore=["tokenizer", "dataset", "validation_dataset"])

    # ------------------------------------------------------------------------------------------------ preprocessing
    @staticmethod
    def _is_paired(rows: Dataset) -> bool:
        return "chosen" in rows.column_names and "rejected" in rows.column_names

    @override
    def _check_rows(self, rows: Dataset, split: str, where: Locator) -> None:
        if (images := vision.image_column(rows.column_names)) is not None:  # KTO's batches carry no pixel values
            raise ValueError(
                f"The {split} data has images (column {images!r}), which KTO does not take yet: its rows would be "
                "trained without their pictures. Drop the column, or train DPOModule on preference pairs with images "
                "(PreferenceDataModule)."
            )
        paired = self._is_paired(rows)
        columns = [c for c in ("prompt", "chosen", "rejected") if c in rows.column_names]
        if not paired:
            columns = [c for c in ("prompt", "completion", "label") if c in rows.column_names]
            if len(columns) < 3:
                return  # _preprocess names the missing columns
        for index, values in enumerate(zip(*(rows[c] for c in columns))):
            row = dict(zip(columns, values))
            try:
                if paired:
                    check_row(row)
                else:
                    self._check_unpaired(row)
            except RowProblem as bad:
                check = _label_problem if bad.column == "label" else functools.partial(value_problem, column=bad.column)
                place, problem = locate_problem(where, index, bad.column, check, bad.problem)
                raise ValueError(
                    f"Malformed preference row at {place}, column {bad.column!r}: {problem}. Fix or drop that row "
                    "(unpaired rows: a prompt, a non-empty completion and a bool label; strings, or lists of "
                    "{'role': str, 'content': str} messages)."
                ) from None

    @staticmethod
    def _check_unpaired(row: dict[str, Any]) -> None:
        """Raise :class:`RowProblem` for a bad cell of an unpaired row (both texts of one format, a bool label)."""
        problem = _label_problem(row["label"])
        if problem is not None:
            raise RowProblem("label", problem)
        try:
            check_row({"prompt": row["prompt"], "chosen": row["completion"], "rejected": row["completion"]})
        except RowProblem as bad:  # the paired check names the completion "chosen"
            raise RowProblem("completion" if bad.column != "prompt" else "prompt", bad.problem) from None

    @override
    def _preprocess(self, rows: Dataset, split: str) -> Dataset:
        self._require_rows(rows, split)
        if self._is_paired(rows):
            rows = unpair_rows(rows)
        missing = [c for c in ("prompt", "completion", "label") if c not in rows.column_names]
        if missing:
            raise ValueError(
                f"The {split} data has no {' and no '.join(map(repr, missing))} column (it has "
                f"{describe_columns(rows)}); KTO data needs 'prompt', 'completion' and a bool 'label' (unpaired), or "
                "'chosen' and 'rejected' with an optional 'prompt' (paired, unpaired automatically). Rename your "
                "columns."
            )
        keep = [c for c in ("answer",) if c in rows.column_names]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DOUBLE_EOS_WARNING)
            data = rows.map(
                tokenize_unpaired,
                batched=True,
                fn_kwargs={"tokenizer": self.tokenizer},
                remove_columns=[c for c in rows.column_names if c not in keep],
                desc=f"Tokenizing {split}",
            )
        limit = self.hparams.max_length
        usable = data.filter(lambda b: [len(p) < limit for p in b["prompt_ids"]], batched=True)
        dropped = len(data) - len(usable)
        truncated = sum(n > limit for n in usable["length"])
        self._count_filtered(
            split,
            truncated,
            ("dropped_prompt_too_long", dropped),
            f"{truncated} rows longer than max_length={limit} keep their first {limit} tokens; {dropped} rows whose "
            "prompt alone reaches max_length were dropped.",
        )
        if len(usable) == 0:
            raise ValueError(
                f"No {split} row is left: all {len(data)} rows had a prompt of >= max_length={limit} tokens. Raise "
                "max_length or shorten the prompts."
            )
        usable = usable.map(lambda b: {"length": [min(n, limit) for n in b["length"]]}, batched=True)
        partners = kl_partner_completions(usable["completion_ids"], self.hparams.batch_size)
        return usable.add_column(KL_COMPLETION_KEY, partners)

    def label_counts(self) -> tuple[int, int] | None:
        """``(desirable, undesirable)`` rows of the training data (after filtering); None before setup.
        :class:`~lit_trainer.modules.kto.KTOModule` checks them against its weights at setup."""
        if self.train_dataset is None:
            return None
        desirable = sum(bool(label) for label in self.train_dataset["label"])
        return desirable, len(self.train_dataset) - desirable

    # ------------------------------------------------------------------------------------------------- batches
    @override
    def _collate(self, rows: list[dict[str, Any]], train: bool) -> dict[str, torch.Tensor]:
        hp = self.hparams
        return UnpairedCollator(self.pad_token_id, hp.max_length, hp.pad_to_multiple_of, hp.mismatched_pairs)(rows)

    @override
    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's examples (KTO's loss is a mean over examples)."""
        return torch.tensor(batch["label"].numel())

    # ------------------------------------------------------------------------- precomputed reference log-probs
    # with ReferenceColumns, what lit_trainer.modules.reference._ref_logps.PrecomputedReference asks of the data
    def reference_loader(
        self, split: str, batch_size: int | None = None, *, num_replicas: int = 1, rank: int = 0
    ) -> EvalLoader:
        """Sequential batches of rows ``rank::num_replicas`` of a split, each as 2B rows: the rows, then their KL
        partners (what the precompute pass scores)."""
        hp = self.hparams
        collator = UnpairedCollator(self.pad_token_id, hp.max_length, hp.pad_to_multiple_of)
        size = batch_size or hp.eval_batch_size or hp.batch_size
        dataset = self.split_dataset(split)
        return EvalLoader(dataset, size, collator.reference_rows, num_replicas=num_replicas, rank=rank)
