"""Shared LightningDataModule base: sources, validation split, tokenizer, samplers and loaders.

Subclasses (SFT, preference, prompt) only say how raw rows become tokenized rows (``_preprocess``), how rows become
a batch (``_collate``) and what a loss item is (``count_items``). Everything else lives here once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_trainer.core.stop_request import stop_for_failure
from lit_trainer.data.bad_rows import BadRows, GuardedCollate
from lit_trainer.data.loader import EvalLoader, LoaderOptions, TrainLoader, validate_loader_options
from lit_trainer.data.packing import PACKED_ROWS
from lit_trainer.data.reasoning_gym import TaskRows
from lit_trainer.data.samplers.batch_sampler import BatchSampler
from lit_trainer.data.samplers.lengths import require_lengths
from lit_trainer.data.samplers.rebalance import CostModel
from lit_trainer.data.samplers.sampling import Sampling, check_sampling, make_batch_sampler
from lit_trainer.data.sources import Locator, any_to_str, load_located_rows, split_validation
from lit_trainer.data.vision.images import image_column
from lit_trainer.data.vision.rows import ROW_KEY
from lit_trainer.data.windows import StepWindows, step_windows
from lit_trainer.models import is_processor, is_vision_source, load_processor, load_tokenizer

# ``builtin:<name>`` data sources of a data module: name -> rows of a split
BuiltinSources = dict[str, Callable[[str], Dataset]]


class BaseDataModule(pl.LightningDataModule):
    """Common options of every lit_trainer data module.

    Args:
        tokenizer: preset name, local directory or hub id (linked to the model's name by the CLI), or a tokenizer
            object from Python. For a vision-language model (``tiny-vl``, a saved one, or a processor object), its
            processor: rows with an ``images``/``image`` column are then processed with it (``docs/vision.md``).
        dataset: ``"builtin:addition"`` (default), a local file or directory (json/jsonl/csv/parquet/txt), a hub
            dataset name, or a ``datasets.Dataset``/``DatasetDict`` from Python.
        validation_dataset: an explicit validation source (same forms); otherwise the source's validation split, or
            ``val_size`` rows held out from training.
        val_size: fraction in (0, 1) or row count held out when the source has no validation split; 0 = none.
        split: training split name of a hub dataset.
        max_length: maximum tokens per row (default 1024, TRL's); longer rows are truncated, counted and reported.
        batch_size: micro-batch size per device (average size for ``batch_rebalance``).
        eval_batch_size: validation batch size (default: ``batch_size``).
        sampling: ``random`` (default), ``sequential``, ``group_by_length`` or ``batch_rebalance``.
        length_column_name: column holding per-row lengths (computed once at preprocessing when absent).
        drop_last: drop incomplete training batches.
        num_workers: DataLoader worker processes (0 = load in the main process).
        persistent_workers: keep workers between epochs (needs ``num_workers > 0``).
        prefetch_factor: batches prefetched per worker (needs ``num_workers > 0``).
        pin_memory: pin host memory for faster host-to-GPU copies.
        seed: data order seed (epoch ``e`` uses ``seed + e``).
        trust_remote_code: passed to ``AutoTokenizer``; False unless set.
        skip_bad_rows: a training row that cannot be loaded during training (a picture that does not decode) is
            skipped: replaced in its batch by a good row, counted in ``data/skipped_rows`` and named in a warning
            (:mod:`lit_trainer.data.bad_rows`). False (default): the run stops with one line naming the row (its file
            and line, or its index in the dataset as given), after a ``JITCheckpoint`` callback saved the last
            finished optimizer step. Text rows are tokenized at setup, where a bad row always stops the run.

    Raises:
        ValueError: on ``max_length <= 0``, ``batch_size < 1``, an unknown ``sampling``, or invalid DataLoader options
            (same rules as ``TrainingArguments``).
    """

    builtin: ClassVar[BuiltinSources] = {}
    # how a ``reasoning_gym:<task>`` source is generated for this data module (None: not read)
    task_rows: ClassVar[TaskRows | None] = None

    def __init__(
        self,
        tokenizer: Any = "tiny",
        dataset: Any = "builtin:addition",
        *,
        validation_dataset: Any = None,
        val_size: float | int = 0.05,
        split: str | None = None,
        max_length: int = 1024,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        sampling: Sampling = "random",
        length_column_name: str = "length",
        drop_last: bool = False,
        num_workers: int = 0,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        seed: int = 1234,
        trust_remote_code: bool = False,
        skip_bad_rows: bool = False,
    ) -> None:
        super().__init__()
        if max_length <= 0:
            raise ValueError(f"`max_length={max_length}` is invalid: it must be a positive number of tokens.")
        if batch_size < 1:
            raise ValueError(f"`batch_size={batch_size}` is invalid: it must be >= 1.")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ValueError(f"`eval_batch_size={eval_batch_size}` is invalid: it must be >= 1 or unset.")
        check_sampling(sampling)
        validate_loader_options(num_workers, persistent_workers, prefetch_factor)
        self.save_hyperparameters(ignore=["tokenizer", "dataset", "validation_dataset"])
        self.tokenizer_source = tokenizer
        self.dataset_source = dataset
        self.validation_source = validation_dataset
        # a vision-language model's processor: its tokenizer is the tokenizer, and it builds the batches of rows with
        # images (lit_trainer.data.vision); None for text models
        self.processor = tokenizer if is_processor(tokenizer) else None
        self.tokenizer = None if isinstance(tokenizer, str) else getattr(self.processor, "tokenizer", tokenizer)
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.stats: dict[str, int] = {}
        # split -> where a row of it is in its source, by the index in ROW_KEY (the index before the validation split)
        self.locators: dict[str, Locator] = {}

    # ----------------------------------------------------------------------------------------------- subclass API
    def _preprocess(self, rows: Dataset, split: str) -> Dataset:
        """Validate and tokenize raw rows; the result must have a ``length`` column. Updates ``self.stats``."""
        raise NotImplementedError

    @staticmethod
    def _require_rows(rows: Dataset, split: str) -> None:
        """Raise a ValueError when the ``split`` data has no row at all."""
        if len(rows) == 0:
            raise ValueError(f"The {split} data is empty: nothing to {'train' if split == 'train' else 'evaluate'} on.")

    def _count_filtered(self, split: str, truncated: int, dropped: tuple[str, int], message: str) -> None:
        """Record ``<split>_rows_truncated`` and ``<split>_rows_<dropped name>`` in ``self.stats``; warn with
        ``message`` when any row was truncated or dropped."""
        self.stats[f"{split}_rows_truncated"] = truncated
        self.stats[f"{split}_rows_{dropped[0]}"] = dropped[1]
        if truncated or dropped[1]:
            rank_zero_warn(f"[lit_trainer] {split}: {message}")

    def _check_rows(self, rows: Dataset, split: str, where: Locator) -> None:
        """Validate raw rows before any split or tokenization; name a bad row with ``where(index)`` (its file and
        line for local files). Default: nothing to check."""

    def _collate(self, rows: list[dict[str, Any]], train: bool) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def count_items(self, batch: dict[str, torch.Tensor]) -> int | torch.Tensor:
        """Loss items in a collated micro-batch (the token-exact accumulation normaliser)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ Lightning API
    @override
    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return
        if self.tokenizer is None:
            trust = self.hparams.trust_remote_code
            if is_vision_source(self.tokenizer_source):
                self.processor = load_processor(self.tokenizer_source, trust_remote_code=trust)
                self.tokenizer = self.processor.tokenizer
            else:
                self.tokenizer = load_tokenizer(self.tokenizer_source, trust_remote_code=trust)
        located, located_validation = load_located_rows(
            self.dataset_source, self.builtin, split=self.hparams.split, task_rows=self.task_rows
        )
        if self.validation_source is not None:
            located_validation = load_located_rows(self.validation_source, self.builtin, task_rows=self.task_rows)[0]
        for split, part in (("train", located), ("validation", located_validation)):
            if part is not None:
                self.locators[split] = part.where or partial(_row_of, split)
            if part is not None and len(part.rows):
                self._check_rows(part.rows, split, self.locators[split])
        train = _indexed(located.rows)
        validation = _indexed(located_validation.rows) if located_validation is not None else None
        if validation is None:
            train, validation = split_validation(train, self.hparams.val_size, self.hparams.seed)
            self.locators["validation"] = self.locators["train"]  # held out of the training source
        if len(train) == 0:
            raise ValueError(f"The training data from {any_to_str(self.dataset_source)} is empty: nothing to train on.")
        self.train_dataset = self._preprocess(train, "train")
        self.val_dataset = self._preprocess(validation, "validation") if validation is not None else None
        self._report()

    def _report(self) -> None:
        """Log the row counts once: ``"7600 training rows packed into 2534 sequences, 500 validation rows, ..."``.

        Training rows are source rows (after drops); with ``packing="bfd"`` the training dataset holds the packed
        sequences (bins) instead, and the data module records the rows packed into them as ``stats[PACKED_ROWS]``.
        """
        packed, train = self.stats.get(PACKED_ROWS), len(self.train_dataset)
        parts = [
            f"{train} training rows" if packed is None else f"{packed} training rows packed into {train} sequences"
        ]
        if self.val_dataset is not None:
            parts.append(f"{len(self.val_dataset)} validation rows")
        parts += [f"{v} {k.replace('_', ' ')}" for k, v in self.stats.items() if v and k != PACKED_ROWS]
        rank_zero_info(f"[lit_trainer] data: {', '.join(parts)} (max_length={self.hparams.max_length}).")

    def _replicas(self) -> tuple[int, int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0, 1
        return trainer.world_size, trainer.global_rank, trainer.accumulate_grad_batches

    def _loader_options(self) -> LoaderOptions:
        """The ``DataLoader`` performance options of this data module's training and validation loaders."""
        return {name: self.hparams[name] for name in LoaderOptions.__annotations__}  # type: ignore[return-value]

    def _step_windows(self) -> Callable[[], StepWindows] | None:
        """The trainer's live optimizer-step windows, for the training loader's window counts."""
        return partial(step_windows, self.trainer) if self.trainer is not None else None

    def longest_row(self) -> int | None:
        """Tokens of the longest row the model sees as one sequence (its positions run from 0), over the training and
        validation data: their ``length`` column, or the rows of packed bins (``seq_lengths``: positions restart at
        every row). None before setup. Modules compare it with the model's positions at setup."""
        longest = None
        for data in (self.train_dataset, self.val_dataset):
            if data is None or len(data) == 0:
                continue
            if "seq_lengths" in data.column_names:
                rows = max(max(lengths) for lengths in data["seq_lengths"])
            elif "length" in data.column_names:
                rows = max(data["length"])
            else:
                continue
            longest = rows if longest is None else max(longest, rows)
        return longest

    def rebalance_cost_model(self) -> CostModel:
        """``batch_rebalance``'s cost model: ``"packed"`` when training micro-batches are padding-free rows
        (``packing="padding_free"``), else ``"padded"`` (``"bfd"`` bins are padded to the longest bin). A preference
        row's length is its prompt plus its longer completion, so a packed DPO pair (both sequences) holds between
        one and two times it: the packed cost balances that proxy."""
        return "packed" if getattr(self.hparams, "packing", "none") == "padding_free" else "padded"

    def lengths(self) -> list[int]:
        """Per-row lengths of the training data, from ``length_column_name`` (computed once at preprocessing).

        Raises:
            ValueError: when the column is missing or incomplete; the message names ``sampling``,
                ``length_column_name`` and the fix.
        """
        return require_lengths(self.train_dataset, self.hparams.length_column_name, sampling=self.hparams.sampling)

    def train_batch_sampler(self) -> BatchSampler:
        """The training batch sampler: which rows form each micro-batch of this rank, by the ``sampling`` strategy
        (:mod:`lit_trainer.data.samplers.sampling`). Called by :meth:`train_dataloader` once the data is set up.

        Override it to change batching: what it returns must follow the
        :class:`~lit_trainer.data.samplers.BatchSampler` protocol (``docs/customizing.md`` has an example,
        ``docs/resume.md`` the contract)."""
        world, rank, accumulate = self._replicas()
        hp = self.hparams
        return make_batch_sampler(
            hp.sampling,
            num_samples=len(self.train_dataset),
            lengths=self.lengths,
            batch_size=hp.batch_size,
            seed=hp.seed,
            num_replicas=world,
            rank=rank,
            accumulate_grad_batches=accumulate,
            drop_last=hp.drop_last,
            cost_model=self.rebalance_cost_model(),
        )

    def _current(self, split: str) -> Callable[[], Dataset]:
        """The ``"train"`` or ``"validation"`` dataset as it is when called: what the loaders read when an iteration
        starts, so that columns added after Lightning built them (precomputed reference log-probs, added at
        ``on_fit_start`` while ``estimated_stepping_batches`` builds the training loader before it) reach their
        batches."""
        attribute = {"train": "train_dataset", "validation": "val_dataset"}[split]
        return lambda: getattr(self, attribute)

    @override
    def train_dataloader(self) -> TrainLoader:
        if self.train_dataset is None:
            self.setup("fit")
        _, _, accumulate = self._replicas()
        hp = self.hparams
        return TrainLoader(
            self._current("train"),
            self.train_batch_sampler(),
            self._guarded_collate(),
            count_items=self.count_items,
            accumulate_grad_batches=accumulate,
            windows=self._step_windows(),
            seed=hp.seed,
            bad_rows=self._bad_rows(),
            **self._loader_options(),
        )

    def row_place(self, row: Mapping[str, Any], split: str = "train") -> str:
        """Where ``row`` (a row of the ``split`` dataset) is in its source: ``"line 7 of data/train.jsonl"``, or
        ``"row 12 of the train data"`` (its index in the dataset as given, before the validation split) for rows not
        read from a JSON-lines/CSV file. Rows with images carry that index (``_row``); other rows are tokenized at
        setup and have none (``"a train row"``)."""
        index = row.get(ROW_KEY)
        if index is None:
            return f"a {split} row"
        return self.locators.get(split, partial(_row_of, split))(int(index))

    def _guarded_collate(self) -> GuardedCollate:
        """The training collate function, naming (or with ``skip_bad_rows`` replacing) the rows it cannot load."""
        return GuardedCollate(
            lambda rows: self._collate(rows, True), self.row_place, self.hparams.skip_bad_rows, self._current("train")
        )

    def _bad_rows(self) -> BadRows:
        """The training loader's handling of bad rows: skip them, or save the last finished step and stop."""
        trainer = self.trainer
        stop = partial(stop_for_failure, trainer) if trainer is not None else None
        return BadRows(self.hparams.skip_bad_rows, stop)

    @override
    def val_dataloader(self) -> EvalLoader | list:
        if self.train_dataset is None:
            self.setup("fit")
        if self.val_dataset is None:
            return []
        world, rank, _ = self._replicas()
        hp = self.hparams
        return EvalLoader(
            self._current("validation"),
            hp.eval_batch_size or hp.batch_size,
            lambda rows: self._collate(rows, False),
            num_replicas=world,
            rank=rank,
            **self._loader_options(),
        )

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id (EOS when it has none)."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id


def _row_of(split: str, index: int) -> str:
    return f"row {index} of the {split} data"


def _indexed(rows: Dataset) -> Dataset:
    """``rows`` with images get their index (``_row``, kept through the validation split and shuffling), by which a
    bad picture met during training is named in its source; text rows are tokenized at setup and need none."""
    if image_column(rows.column_names) is None or ROW_KEY in rows.column_names:
        return rows
    return rows.add_column(ROW_KEY, list(range(len(rows))))
