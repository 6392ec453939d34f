"""SFTDataModule: plain text or prompt/completion rows for causal-LM fine-tuning."""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_trainer.data import builtin
from lit_trainer.data.base import BaseDataModule
from lit_trainer.data.collate import PackedCollator, SFTCollator, common_prefix_len
from lit_trainer.data.packing import Packing, check_packing_options, pack_dataset
from lit_trainer.data.sources import Locator, check_cells, describe_columns, missing_or_not_text
from lit_trainer.losses.causal_lm import count_target_tokens


class SFTDataModule(BaseDataModule):
    """Supervised fine-tuning data: a ``text`` column, or ``prompt`` + ``completion`` columns.

    Text rows are trained on every token. Prompt/completion rows are trained on the completion only (the prompt's
    labels are ``-100``), with the prompt boundary found as the common prefix of ``tok(prompt)`` and
    ``tok(prompt + completion)`` (so BOS/EOS conventions of any tokenizer are respected). An EOS token ends every
    row. Rows longer than ``max_length`` are truncated (kept from the start) and counted; rows left without any
    target token (the prompt alone fills ``max_length``) are dropped and counted. A ``length`` column is added once.

    Args:
        text_column: name of the plain-text column.
        prompt_column: name of the prompt column.
        completion_column: name of the completion column.
        pad_to_multiple_of: round padded lengths up to a multiple.
        packing: training batches as ``"none"`` (right-padded), ``"padding_free"`` (each micro-batch's
            ``batch_size`` rows flattened into one row, ``position_ids`` restarting per row, no padding) or ``"bfd"``
            (rows grouped at setup into bins of ``max_length`` tokens by best-fit decreasing; ``batch_size`` bins per
            micro-batch, each bin one row). Validation batches stay padded. See :mod:`lit_trainer.data.packing`.
        max_tokens_per_batch: with ``packing="bfd"``, the bin size in tokens (>= ``max_length``) with one bin per
            micro-batch (``batch_size`` must be 1): the micro-batch token budget. Unset: bins of ``max_length``.
        **kwargs: the options of :class:`~lit_trainer.data.base.BaseDataModule` (``tokenizer``, ``dataset``,
            ``max_length``, ``batch_size``, ``sampling``, DataLoader options, ...).

    Example::

        dm = SFTDataModule(tokenizer="tiny", dataset="builtin:addition", batch_size=64, max_length=32)
        trainer.fit(CausalLMModule("tiny"), datamodule=dm)
    """

    builtin = {"builtin:addition": builtin.sft_rows}

    def __init__(
        self,
        *args: Any,
        text_column: str = "text",
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        pad_to_multiple_of: int | None = None,
        packing: Packing = "none",
        max_tokens_per_batch: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_packing_options(packing, max_tokens_per_batch, self.hparams)
        self.save_hyperparameters(ignore=["tokenizer", "dataset", "validation_dataset"])

    def _row_format(self, rows: Dataset, split: str) -> str:
        hp, columns = self.hparams, rows.column_names
        if hp.prompt_column in columns and hp.completion_column in columns:
            return "prompt_completion"
        if hp.text_column in columns:
            return "text"
        raise ValueError(
            f"The {split} data has no {hp.text_column!r} column and no {hp.prompt_column!r} + "
            f"{hp.completion_column!r} columns (it has {describe_columns(rows)}). Rename your columns or set "
            "`text_column` / `prompt_column` / `completion_column`."
        )

    @override
    def _check_rows(self, rows: Dataset, split: str, where: Locator) -> None:
        hp = self.hparams
        fmt = self._row_format(rows, split)
        columns = (hp.prompt_column, hp.completion_column) if fmt == "prompt_completion" else (hp.text_column,)
        check_cells(rows, columns, where, missing_or_not_text, "SFT row")

    def _tokenize(self, batch: dict[str, list], fmt: str) -> dict[str, list]:
        tok, hp = self.tokenizer, self.hparams
        eos = tok.eos_token_id
        if fmt == "text":
            full = tok(batch[hp.text_column])["input_ids"]
            prompt_lengths = [0] * len(full)
        else:
            prompts = batch[hp.prompt_column]
            full = tok([p + c for p, c in zip(prompts, batch[hp.completion_column])])["input_ids"]
            prompt_ids = tok(prompts)["input_ids"]
            prompt_lengths = [common_prefix_len(p, f) for p, f in zip(prompt_ids, full)]
        out: dict[str, list] = {"input_ids": [], "prompt_length": [], "length": [], "truncated": []}
        for ids, plen in zip(full, prompt_lengths):
            if eos is not None and (not ids or ids[-1] != eos):
                ids = ids + [eos]
            out["truncated"].append(len(ids) > hp.max_length)
            ids = ids[: hp.max_length]
            out["input_ids"].append(ids)
            out["prompt_length"].append(min(plen, len(ids)))
            out["length"].append(len(ids))
        return out

    @override
    def _preprocess(self, rows: Dataset, split: str) -> Dataset:
        fmt = self._row_format(rows, split)
        if len(rows) == 0:
            raise ValueError(f"The {split} data is empty: nothing to {'train' if split == 'train' else 'evaluate'} on.")
        keep = ["answer"] if "answer" in rows.column_names else []
        data = rows.map(lambda b: self._tokenize(b, fmt), batched=True,
                        remove_columns=[c for c in rows.column_names if c not in keep], desc=f"Tokenizing {split}")
        truncated = sum(data["truncated"])
        usable = data.filter(lambda b: [p < n for p, n in zip(b["prompt_length"], b["length"])], batched=True)
        dropped = len(data) - len(usable)
        self.stats[f"{split}_rows_truncated"] = truncated
        self.stats[f"{split}_rows_dropped_without_target"] = dropped
        if truncated or dropped:
            rank_zero_warn(f"[lit_trainer] {split}: {truncated} rows longer than max_length={self.hparams.max_length} "
                           f"were truncated; {dropped} rows had no completion token left and were dropped.")
        if len(usable) == 0:
            raise ValueError(f"No {split} row has a completion token within max_length={self.hparams.max_length}: "
                             "raise max_length or shorten the prompts.")
        usable = usable.remove_columns("truncated")
        if split == "train" and self.hparams.packing == "bfd":
            usable = pack_dataset(usable, self.hparams.max_tokens_per_batch or self.hparams.max_length,
                                  self.hparams.length_column_name)
            self.stats["train_packed_bins"] = len(usable)
        return usable

    @override
    def _collate(self, rows: list[dict[str, Any]], train: bool) -> dict[str, torch.Tensor]:
        if train and self.hparams.packing != "none":
            return PackedCollator(self.pad_token_id)(rows)
        collator = SFTCollator(self.pad_token_id, self.hparams.pad_to_multiple_of, generation_inputs=not train)
        return collator(rows)

    @override
    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Target tokens after the causal shift."""
        return count_target_tokens(batch["labels"])
