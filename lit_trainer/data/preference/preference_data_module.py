"""PreferenceDataModule: prompt/chosen/rejected rows for DPO, preprocessed and collated as TRL 1.16's DPOTrainer.

Preprocessing (as TRL's DPOTrainer), in order: rows are validated before any split (a malformed row raises an error
naming its file and line, or its index, and its column); an implicit prompt (no ``prompt`` column) is extracted as
the common prefix of chosen and rejected; standard (string) rows get the tokenizer's EOS string appended to each
completion; then ``prompt_ids = tok(prompt)``, ``tok(prompt + chosen)`` and ``tok(prompt + rejected)`` (the chat
template with ``add_generation_prompt=True`` for the prompt, when rows are conversations) are split at their common
prefix. With ``truncation_mode="keep_start"``, rows whose prompt alone reaches ``max_length`` are dropped and
counted; pairs whose chosen and rejected rows are the same tokens are counted, reported and kept (as TRL), or
dropped with ``drop_identical_pairs=True``.

Collation: :class:`~lit_trainer.data.preference.collate.PreferenceCollator`; precomputed reference log-probs are
stored as dataset columns by :meth:`PreferenceDataModule.set_reference_logps`.
The row checks (``_checks``), the functions mapped over the rows (``_tokenize``: module-level, so that ``datasets``
fingerprints them without pickling the data module) and the pair collation (``collate``, which DPO's scoring also
reads) are beside this file in the package.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, ClassVar, Literal, get_args

import torch
from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_trainer.data import builtin, builtin_shapes, vision
from lit_trainer.data.base import BaseDataModule, BuiltinSources
from lit_trainer.data.loader import EvalLoader
from lit_trainer.data.packing import check_packing_options, row_completion_mask
from lit_trainer.data.preference._checks import RowProblem, check_row, value_problem
from lit_trainer.data.preference._tokenize import TOKEN_COLUMNS, extract_prompt, measure_image_pair, tokenize_pairs
from lit_trainer.data.preference.collate import (
    MARGIN_KEY,
    REF_CHOSEN_KEY,
    REF_REJECTED_KEY,
    PreferenceCollator,
    TruncationMode,
    end_with_eos,
)
from lit_trainer.data.reasoning_gym import TaskRows
from lit_trainer.data.reference_columns import ReferenceColumns
from lit_trainer.data.sources import Locator, check_cells, describe_columns, locate_problem, missing_or_not_text
from lit_trainer.data.vision import rows as vision_rows
from lit_trainer.data.vision.messages import count_placeholders
from lit_trainer.data.vision.preference import VisionPreferenceCollator

__all__ = ["TOKEN_COLUMNS", "PreferenceDataModule", "PreferencePacking", "end_with_eos", "extract_prompt"]

PreferencePacking = Literal["none", "padding_free"]  # packing values that apply to pairs ("bfd" is for SFT rows)
_DOUBLE_EOS_WARNING = r"This sequence already has"  # ByT5's notice when the text already ends with "</s>"


def _check_margins(margins: list[Any], split: str) -> None:
    """Raise on the first ``margin`` cell that is not a finite number (it would fail deep inside the collator)."""
    for index, value in enumerate(margins):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(
                f"The {split} data's 'margin' column holds {value!r} at row {index}: margins must be finite numbers "
                "(the reward model's loss subtracts them). Fix or drop that row, or remove the column."
            )


def _completion_problem(value: Any, chat: bool, image_token: str) -> str | None:
    """What is wrong with a chosen or rejected cell of a row with images (None when it is valid): a malformed
    conversation or text, or an image placeholder (a pair's images belong to its prompt)."""
    if chat:
        problem = vision_rows.conversation_problem(value)
        if problem is None and count_placeholders(value):
            problem = "an image part in a completion: a pair's images go into its prompt (the first user turn)"
        return problem
    problem = value_problem(value, "chosen") if isinstance(value, str) else missing_or_not_text(value)
    if problem is None and image_token in value:
        problem = f"the image token {image_token!r} in a completion: a pair's images go into its prompt"
    return problem


class PreferenceDataModule(ReferenceColumns, BaseDataModule):
    """Preference pairs for :class:`~lit_trainer.modules.dpo.DPOModule` and
    :class:`~lit_trainer.modules.reward.RewardModule` (TRL 1.16 preprocessing and collation).

        Rows are ``{"prompt", "chosen", "rejected"}`` (explicit prompt) or ``{"chosen", "rejected"}`` (implicit prompt,
        split off as the common prefix); each is standard (strings) or conversational (lists of ``{"role", "content"}``
        messages, rendered with ``tokenizer.chat_template``; optional ``tools`` and ``chat_template_kwargs`` columns are
        forwarded; an optional numeric ``margin`` column is kept and collated as a float ``margin`` (B,), for
        :class:`~lit_trainer.modules.reward.RewardModule`). ``count_items`` gives two counts: PAIRS (the pair losses
        are per-pair means) and chosen completion tokens after the causal shift (the ``"sft"`` term is a token
        mean). The ``length`` column holds the longer of prompt+chosen and prompt+rejected (capped at
        ``max_length``), for the length-aware samplers.
        Counters in ``self.stats``: ``<split>_rows_truncated``, ``<split>_rows_dropped_prompt_too_long`` (with
        ``truncation_mode="drop"``: ``<split>_rows_dropped_too_long``) and ``<split>_rows_identical_pairs``.

        Differs from the reference: the row format (standard or conversational) and EOS handling are decided per row
        instead of by the first row; malformed rows raise a ValueError naming the row and column instead of failing
        inside the tokenizer or training on empty completions.

        Rows with images (an ``images`` or ``image`` column, and a vision-language model's processor as ``tokenizer``,
        e.g. ``"tiny-vl"``; ``builtin:shapes`` holds such pairs) need an explicit ``prompt``, which holds the images:
        ``{"type": "image"}`` parts of its turns, or, with string contents, placed first in its first user turn; string
        rows write the processor's image token in the prompt text. They are checked and measured at setup without
        decoding an image, and processed batch by batch by
        :class:`~lit_trainer.data.vision.preference.VisionPreferenceCollator` (the text batch's layout plus the image
        inputs, each pair's images for both its rows). ``keep_end``, packing and precomputed reference log-probs are
        refused for them.

        Args:
            truncation_mode: ``keep_start`` (default; rows whose prompt alone has ``>= max_length`` tokens are dropped),
                ``keep_end`` (keeps each row's last ``max_length`` tokens; nothing is dropped) or ``drop`` (nothing is
                cut: pairs whose prompt+chosen or prompt+rejected is longer than ``max_length`` are dropped, counted
                as ``<split>_rows_dropped_too_long``; TRL's ``RewardTrainer`` filter, for reward models, whose score
                is read at a row's last token).
            pad_to_multiple_of: round padded lengths up to a multiple.
            packing: ``"none"`` (right-padded) or ``"padding_free"``: each training micro-batch's 2B rows flattened into
                one row, ``position_ids`` restarting per row, no padding (TRL's ``padding_free``); validation and the
                reference log-prob pass stay padded. See :mod:`lit_trainer.data.packing`.
            drop_identical_pairs: drop the pairs whose chosen and rejected rows are the same tokens once truncated
                (e.g. ``"4"`` and ``"4</s>"``). Default False: kept, as TRL. They are counted
                (``<split>_rows_identical_pairs``) and reported in one warning either way. Such a pair adds no
                gradient to a loss of the chosen-minus-rejected difference (``sigmoid``, ``ipo``, the reward model's
                Bradley-Terry loss, ...) but counts in its pair mean, so dropping them scales the step's gradient by
                ``all pairs / kept pairs``; losses that score chosen or rejected on its own (``"sft"``,
                ``nca_pair``, ``bco_pair``, ``apo_zero``, the reward model's centring term) do learn from them.
            **kwargs: the options of :class:`~lit_trainer.data.base.BaseDataModule` (``tokenizer``, ``dataset``,
                ``max_length``, ``batch_size``, ``sampling``, DataLoader options, ...).

        Raises:
            ValueError: an unknown ``truncation_mode``; at setup, missing columns, a malformed row (its file and line,
                or index, and its column are named), conversational rows without a chat template, or no row left after
                filtering.

        Example::

            dm = PreferenceDataModule(tokenizer="tiny", dataset="builtin:addition", batch_size=32, max_length=32)
            trainer.fit(DPOModule("tiny", loss_type=["sigmoid", "sft"]), datamodule=dm)
    """

    REFERENCE_COLUMNS = (REF_CHOSEN_KEY, REF_REJECTED_KEY)
    TOKEN_COLUMNS = TOKEN_COLUMNS
    FINGERPRINT_OPTIONS = ("max_length", "truncation_mode")
    builtin: ClassVar[BuiltinSources] = {
        "builtin:addition": builtin.preference_rows,
        "builtin:subtraction": builtin.subtraction_preference_rows,
        "builtin:shapes": builtin_shapes.preference_rows,
    }
    task_rows: ClassVar[TaskRows | None] = "preference"

    def __init__(
        self,
        *args: Any,
        truncation_mode: TruncationMode = "keep_start",
        pad_to_multiple_of: int | None = None,
        drop_identical_pairs: bool = False,
        packing: PreferencePacking = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if packing == "bfd":
            raise ValueError(
                f"`packing='bfd'` is for SFT rows; preference pairs support packing='padding_free' "
                f"(choices: {get_args(PreferencePacking)})."
            )
        check_packing_options(packing, None, self.hparams)
        if truncation_mode not in get_args(TruncationMode):
            raise ValueError(
                f"`truncation_mode={truncation_mode!r}` is invalid: use one of {get_args(TruncationMode)}."
            )
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"`pad_to_multiple_of={pad_to_multiple_of}` is invalid: use an integer >= 1 or None.")
        self.save_hyperparameters(ignore=["tokenizer", "dataset", "validation_dataset"])
        self._images: str | None = None  # the image column of rows with images (processed per batch)

    # ------------------------------------------------------------------------------------------------ preprocessing
    @override
    def _check_rows(self, rows: Dataset, split: str, where: Locator) -> None:
        columns = [c for c in ("prompt", "chosen", "rejected") if c in rows.column_names]
        if "chosen" not in columns or "rejected" not in columns:
            return  # _preprocess names the missing columns
        if (images := vision.image_column(rows.column_names)) is not None:
            return self._check_image_rows(rows, images, split, where)
        for index, values in enumerate(zip(*(rows[c] for c in columns))):
            try:
                check_row(dict(zip(columns, values)))
            except RowProblem as bad:
                check = functools.partial(value_problem, column=bad.column)
                place, problem = locate_problem(where, index, bad.column, check, bad.problem)
                message = (
                    f"Malformed preference row at {place}, column {bad.column!r}: {problem}. Fix "
                    "or drop that row (chosen and rejected must be non-empty strings, or lists of "
                    "{'role': str, 'content': str} messages)."
                )
                raise ValueError(message) from None

    @override
    def _preprocess(self, rows: Dataset, split: str) -> Dataset:
        missing = [c for c in ("chosen", "rejected") if c not in rows.column_names]
        if missing:
            raise ValueError(
                f"The {split} data has no {' and no '.join(map(repr, missing))} column (it has "
                f"{describe_columns(rows)}); preference data needs 'chosen' and 'rejected' columns "
                "and optionally 'prompt'. Rename your columns."
            )
        self._require_rows(rows, split)
        if (images := vision.image_column(rows.column_names)) is not None:
            self._images = images
            return self._filter_pairs(self._keep_image_rows(rows, split, images), split)
        if MARGIN_KEY in rows.column_names:
            _check_margins(rows[MARGIN_KEY], split)
        explicit, hp = "prompt" in rows.column_names, self.hparams
        keep = [c for c in ("answer", MARGIN_KEY) if c in rows.column_names]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DOUBLE_EOS_WARNING)
            options = {"explicit": explicit, "max_length": hp.max_length, "truncation_mode": hp.truncation_mode}
            data = rows.map(
                tokenize_pairs,
                batched=True,
                fn_kwargs={"tokenizer": self.tokenizer, **options},
                remove_columns=[c for c in rows.column_names if c not in keep],
                desc=f"Tokenizing {split}",
            )
        return self._filter_pairs(data, split)

    def _filter_pairs(self, data: Dataset, split: str) -> Dataset:
        """Drop (and count) the pairs ``truncation_mode`` drops and, with ``drop_identical_pairs``, the identical
        ones; count the truncated ones. Text pairs give their prompt length as ``prompt_ids``, pairs with images as
        ``prompt_tokens`` (their estimate, image tokens included)."""
        usable, limit, mode = data, self.hparams.max_length, self.hparams.truncation_mode
        if mode == "keep_start" and "prompt_tokens" in data.column_names:
            usable = data.filter(lambda b: [n < limit for n in b["prompt_tokens"]], batched=True)
        elif mode == "keep_start":
            usable = data.filter(lambda b: [len(p) < limit for p in b["prompt_ids"]], batched=True)
        elif mode == "drop":  # TRL RewardTrainer: a pair is kept only when both its rows fit whole
            usable = data.filter(lambda b: [not t for t in b["truncated"]], batched=True)
        dropped = len(data) - len(usable)
        usable, identical = self._identical_pairs(usable, split)
        truncated = sum(usable["truncated"])
        why = "whose prompt alone reaches" if mode != "drop" else "with a row longer than"
        self._count_filtered(
            split,
            truncated,
            ("dropped_prompt_too_long" if mode != "drop" else "dropped_too_long", dropped),
            f"{truncated} preference rows longer than max_length={limit} are truncated ({mode}); {dropped} rows "
            f"{why} max_length were dropped.",
        )
        if len(usable) == 0:
            fix = (
                "raise max_length or shorten the prompts; their image tokens count"
                if "prompt_tokens" in data.column_names
                else "raise max_length, shorten the prompts or use truncation_mode='keep_end'"
            )
            raise ValueError(
                f"No {split} row is left: of {len(data)} rows, {dropped} had a prompt of >= "
                f"max_length={limit} tokens ({fix}) and {identical} had chosen == rejected (zero gradient; "
                "drop_identical_pairs=False keeps them)."
                if mode != "drop"
                else f"No {split} row is left: of {len(data)} rows, {dropped} had a chosen or rejected row longer "
                f"than max_length={limit} tokens (truncation_mode='drop'; raise max_length or shorten the rows) "
                f"and {identical} had chosen == rejected (drop_identical_pairs=False keeps them)."
            )
        return usable.remove_columns([c for c in ("truncated", "identical", "prompt_tokens") if c in data.column_names])

    def _identical_pairs(self, data: Dataset, split: str) -> tuple[Dataset, int]:
        """Count (and with ``drop_identical_pairs`` drop) the pairs whose chosen and rejected inputs are the same;
        warn once."""
        count = sum(data["identical"])
        self.stats[f"{split}_rows_identical_pairs"] = count
        if not count:
            return data, 0
        drop = self.hparams.drop_identical_pairs
        rank_zero_warn(
            f"[lit_trainer] {split}: {count} preference rows have identical chosen and rejected tokens "
            f"(after truncation to max_length={self.hparams.max_length}): a loss of the chosen-minus-rejected "
            "difference gets no gradient from them, but counts them in its pair mean; "
            + (
                "they were dropped (drop_identical_pairs=True; drop_identical_pairs=False, the default, keeps them "
                "as TRL does)."
                if drop
                else "they are kept, as TRL (drop_identical_pairs=False; True drops them)."
            )
        )
        return (data.filter(lambda b: [not x for x in b["identical"]], batched=True) if drop else data), count

    # ------------------------------------------------------------------------------------------- rows with images
    def _check_image_rows(self, rows: Dataset, images: str, split: str, where: Locator) -> None:
        """Refuse, naming the first bad row: a text-only tokenizer, no explicit prompt, ``keep_end``, a malformed
        cell, an image that cannot be read, placeholders in the prompt that do not match the row's images, or an
        image placeholder in a completion (the images belong to the prompt)."""
        what, hp = f"The preference {split} data", self.hparams
        if self.processor is None:
            vision_rows.refuse_text_model(vision_rows.undecoded(rows, images), images, where, what)
        if "prompt" not in rows.column_names:
            raise ValueError(
                f"{what} has images (column {images!r}) but no 'prompt' column: a pair's images go into its prompt "
                "(the first user turn), which rows with images must give explicitly. Add a 'prompt' column (the "
                "turns or text before the answers) and keep only the answers in 'chosen' and 'rejected'."
            )
        if hp.truncation_mode == "keep_end":
            raise ValueError(
                "`truncation_mode='keep_end'` is not supported for rows with images: the images are in the prompt, "
                "at the start of each row, and keeping a row's end would cut their tokens (TRL refuses it too). "
                "Use truncation_mode='keep_start' (the default) or 'drop'."
            )
        image_token = getattr(self.processor, "image_token", None) or "<image>"
        chat = len(rows) > 0 and not isinstance(rows[0]["chosen"], str)
        check_cells(rows, ("prompt",), where, vision_rows.conversation_problem if chat else missing_or_not_text,
                    "preference row")  # fmt: skip
        check_cells(rows, ("chosen", "rejected"), where, functools.partial(_completion_problem, chat=chat,
                    image_token=image_token), "preference row")  # fmt: skip
        vision_rows.check_image_rows(
            vision_rows.undecoded(rows, images), images, where,
            conversations=("prompt",) if chat else (), texts=() if chat else ("prompt",), image_token=image_token,
        )  # fmt: skip

    def _keep_image_rows(self, rows: Dataset, split: str, images: str) -> Dataset:
        """The rows as they are (images undecoded) with ``row``, ``length`` and the columns :meth:`_filter_pairs`
        reads, estimated from the rendered texts: each image placeholder counts as the tokens it expands to."""
        if self.hparams.packing != "none":
            raise ValueError(
                f"`packing={self.hparams.packing!r}` is not supported for rows with images: a packed row would need "
                "each image's tokens kept whole and every image of the 2B rows passed with it in order, which no "
                "vision-language model's forward checks. Set packing='none' (TRL does not pack images either)."
            )
        options = {
            "collator": VisionPreferenceCollator(self.processor, images, self.hparams.max_length, split),
            "per_image": vision_rows.image_tokens_per_image(self.processor),
        }
        rows = vision_rows.undecoded(rows, images)
        return rows.map(measure_image_pair, with_indices=True, fn_kwargs=options, desc=f"Measuring {split} rows")

    def _refuse_precomputed_images(self) -> None:
        if self._images is not None:
            raise ValueError(
                "`precompute_ref_log_probs=True` is not supported for preference rows with images: the pairs are "
                "processed batch by batch (their pixel values are never stored), so there are no tokens to key the "
                "stored log-probs by. Set precompute_ref_log_probs=False: the reference model then scores every "
                "batch with the same images as the policy (TRL 1.16 refuses it as well)."
            )

    @override
    def fingerprint(self, split: str) -> str:
        """The data key of the precomputed reference log-probs (refused for rows with images)."""
        self.split_dataset(split)
        self._refuse_precomputed_images()
        return super().fingerprint(split)

    # ------------------------------------------------------------------------------------------------- batches
    @override
    def _collate(self, rows: list[dict[str, Any]], train: bool) -> dict[str, torch.Tensor]:
        hp = self.hparams
        if self._images is not None:
            split = "train" if train else "validation"
            place = functools.partial(self.row_place, split=split)
            return VisionPreferenceCollator(
                self.processor, self._images, hp.max_length, split, hp.pad_to_multiple_of, place
            )(rows)
        return PreferenceCollator(
            self.pad_token_id,
            hp.max_length,
            hp.truncation_mode,
            hp.pad_to_multiple_of,
            packed=train and hp.packing == "padding_free",
        )(rows)

    @override
    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[pairs, chosen completion tokens, chosen tokens]`` of the micro-batch: pairs are half its rows (chosen rows
        first); the tokens are the chosen rows' completion positions after the causal shift (the "sft" term's items)
        and all their predicted positions, prompt included (ORPO's NLL term)."""
        mask = row_completion_mask(batch)
        pairs = mask.size(0) // 2
        if "seq_lengths" in batch:  # padding-free: one packed row, the rows' lengths alongside
            sequence = (batch["seq_lengths"][:pairs] - 1).clamp(min=0).sum()
        else:
            sequence = batch["attention_mask"][:pairs, 1:].sum()
        return torch.stack([torch.tensor(pairs), mask[:pairs, 1:].sum(), sequence])

    # ------------------------------------------------------------------------- precomputed reference log-probs
    def reference_loader(
        self, split: str, batch_size: int | None = None, *, num_replicas: int = 1, rank: int = 0
    ) -> EvalLoader:
        """Sequential batches of rows ``rank::num_replicas`` of a split (for computing reference log-probs)."""
        dataset = self.split_dataset(split)
        self._refuse_precomputed_images()
        size = batch_size or self.hparams.eval_batch_size or self.hparams.batch_size
        return EvalLoader(dataset, size, lambda rows: self._collate(rows, False), num_replicas=num_replicas, rank=rank)
