"""The data side of precomputed reference log-probs, shared by the data modules whose module can score its rows with
a frozen reference once at fit start (``PreferenceDataModule`` for DPO, ``UnpairedPreferenceDataModule`` for KTO).

A data module stores two values per row as two columns (DPO: the chosen and the rejected completion's log-probs; KTO:
the row's and its KL partner's), keyed by what they were computed from, so a second module given the same data with
the same reference reuses them. The precompute pass itself is the reference model's
(:mod:`lit_trainer.modules.reference._ref_logps`); this mixin is what it asks of the data: the split, a content hash
of its tokens, the stored values and where to store new ones.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import numpy as np
import torch
from datasets import Dataset


class ReferenceColumns:
    """Mixin for a ``BaseDataModule``: per-row reference log-probs stored as the columns :attr:`REFERENCE_COLUMNS`.

    A subclass sets :attr:`REFERENCE_COLUMNS` (the two column names), :attr:`TOKEN_COLUMNS` (the token columns the
    values depend on) and :attr:`FINGERPRINT_OPTIONS` (the hyperparameters that change the tokens), and writes
    ``reference_loader``. :attr:`FINGERPRINT_TAG` starts the hash (data modules of different row kinds never share a
    key).
    """

    REFERENCE_COLUMNS: ClassVar[tuple[str, str]]
    TOKEN_COLUMNS: ClassVar[tuple[str, ...]]
    FINGERPRINT_OPTIONS: ClassVar[tuple[str, ...]] = ("max_length",)
    FINGERPRINT_TAG: ClassVar[str] = ""
    train_dataset: Dataset | None
    val_dataset: Dataset | None
    hparams: Any

    def _reference_state(self) -> tuple[dict[str, str], dict[str, str]]:
        """``(fingerprints, reference keys)`` per split, created on first use."""
        if not hasattr(self, "_reference_columns_state"):
            self._reference_columns_state: tuple[dict[str, str], dict[str, str]] = ({}, {})
        return self._reference_columns_state

    def split_dataset(self, split: str) -> Dataset | None:
        """The preprocessed ``"train"`` or ``"validation"`` dataset (None when there is no validation data)."""
        if self.train_dataset is None:
            self.setup("fit")  # type: ignore[attr-defined]
        datasets = {"train": self.train_dataset, "validation": self.val_dataset}
        if split not in datasets:
            raise ValueError(f"Unknown split {split!r}: use 'train' or 'validation'.")
        return datasets[split]

    def fingerprint(self, split: str) -> str:
        """A content hash of the split's token columns and the options that shape them: the data key of the
        reference log-probs. Computed from the tokens themselves, so it is stable across processes and runs (unlike a
        ``datasets`` fingerprint after a ``map`` with a closure) and unaffected by the reference columns."""
        fingerprints, _ = self._reference_state()
        if split not in fingerprints:
            options = "|".join(str(self.hparams[name]) for name in self.FINGERPRINT_OPTIONS)
            digest = hashlib.sha256(f"{self.FINGERPRINT_TAG}{options}".encode())
            arrow = self.split_dataset(split).with_format("arrow")
            for start in range(0, len(arrow), 8192):
                table = arrow[start : start + 8192]
                for name in self.TOKEN_COLUMNS:
                    column = table.column(name).combine_chunks()
                    digest.update(np.asarray(column.value_lengths(), dtype=np.int64).tobytes())
                    digest.update(np.asarray(column.flatten(), dtype=np.int64).tobytes())
            fingerprints[split] = digest.hexdigest()
        return fingerprints[split]

    def reference_logps_key(self, split: str) -> str | None:
        """The key given with the split's current reference log-probs (None when it has none)."""
        return self._reference_state()[1].get(split)

    def reference_logps(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The split's stored reference log-probs, one tensor per column of :attr:`REFERENCE_COLUMNS`."""
        dataset = self.split_dataset(split)
        first, second = self.REFERENCE_COLUMNS
        return torch.tensor(dataset[first]), torch.tensor(dataset[second])

    def set_reference_logps(self, split: str, first: torch.Tensor, second: torch.Tensor, key: str) -> None:
        """Store per-row reference log-probs as the split's two :attr:`REFERENCE_COLUMNS` columns.

        Raises:
            ValueError: when the tensors do not hold one value per row.
        """
        dataset = self.split_dataset(split)
        if first.shape != (len(dataset),) or second.shape != (len(dataset),):
            raise ValueError(
                f"Reference log-probs of shape {tuple(first.shape)}/{tuple(second.shape)} do not match the "
                f"{len(dataset)} rows of the {split} data."
            )
        dataset = dataset.remove_columns([c for c in self.REFERENCE_COLUMNS if c in dataset.column_names])
        for name, values in zip(self.REFERENCE_COLUMNS, (first, second)):
            dataset = dataset.add_column(name, values.float().tolist())
        if split == "train":
            self.train_dataset = dataset
        else:
            self.val_dataset = dataset
        self._reference_state()[1][split] = key
