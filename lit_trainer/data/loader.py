"""The training loader: resumable, rank-aware, and token-exact over an accumulation window.

Why not a plain ``torch.utils.data.DataLoader``? Lightning rewrites a ``DataLoader`` it is given for training
(docs/design.md#lightning-distributed-sampler): under DDP it forces shuffling and wraps any custom sampler in a
``DistributedSamplerWrapper`` that re-shuffles it; on resume it replays the epoch from batch 0
(docs/design.md#lightning-resume-position); and every ``iter()`` draws a worker seed from the global RNG.
:class:`TrainLoader` is an iterable that Lightning leaves alone (it only wraps ``DataLoader`` instances) but treats
as stateful (``state_dict``/``load_state_dict`` are saved in ``loops.fit_loop.state_dict.combined_loader`` and
restored before the resumed epoch starts). Inside, a normal ``DataLoader`` does the loading, with workers, pinning
and prefetching.

Token-exact gradient accumulation needs the number of loss items of the whole optimizer step before the first
micro-batch of that step runs backward (docs/design.md#hf-num-items). The loader therefore fetches the
``accumulate_grad_batches`` micro-batches of a window ahead (as the HF Trainer does) and attaches the window's local
count to each of them as ``batch["num_items_in_batch"]`` (an int64 tensor: 0-dim, or one entry per count when
``count_items`` returns several, e.g. DPO's pairs and chosen tokens). The windows are the ones Lightning steps on
(:mod:`lit_trainer.data.windows`), read from the trainer when each window starts: ``accumulate_grad_batches`` as it
is now (a ``GradientAccumulationScheduler`` changes it per epoch) and the epoch's length after
``limit_train_batches``, so a window cut by the limit counts only the micro-batches that train.

Both loaders read their dataset when an iteration starts, not when they are built: the data modules hand them a
function returning the split as it is then. Lightning may build a loader long before its first batch (reading
``trainer.estimated_stepping_batches`` in ``configure_optimizers`` builds the training loader before ``on_fit_start``),
and a column added in between (DPO's and KTO's precomputed reference log-probs) must still reach every batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, TypedDict

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from typing_extensions import Unpack

from lit_trainer.data.bad_rows import SKIPPED_KEY, BadRowError, BadRows
from lit_trainer.data.samplers.batch_sampler import BatchSampler
from lit_trainer.data.windows import StepWindows

NUM_ITEMS_KEY = "num_items_in_batch"
# a map-style dataset, or a function returning the current one (read at the start of every iteration)
DatasetSource = Dataset | Callable[[], Dataset]


class TrainLoader:
    """A resumable training loader that attaches window item counts for token-exact accumulation.

    Args:
        dataset: a map-style dataset returning dict rows, or a function returning it, called when each iteration
            starts (a data module's split as it is then; a dataset of another length is refused).
        batch_sampler: a :class:`~lit_trainer.data.samplers.BatchSampler` (rank-aware, ``set_epoch``, same length
            on every rank, ``state_dict``/``load_state_dict``). It owns the epoch and the resume point: the loader
            seeks it with ``load_state_dict`` at every epoch start and only counts the micro-batches it has handed
            to the training loop (the inner ``DataLoader`` prefetches, so the sampler itself runs ahead of training).
        collate_fn: turns a list of rows into a dict of tensors.
        count_items: returns the number of loss items in a collated micro-batch (target tokens for SFT), or a 1-D
            tensor of several counts (DPO: pairs and chosen tokens). ``None`` disables the count.
        accumulate_grad_batches: micro-batches per optimizer step, used only while no ``windows`` source is set.
        windows: returns the trainer's current :class:`~lit_trainer.data.windows.StepWindows` (the data modules
            pass ``partial(step_windows, trainer)``; a ``BaseModule`` sets it on a loader that has none when
            training starts). Read at the start of every window.
        seed: base seed of the worker seeds (epoch ``e`` uses ``seed + e``), so no global RNG draw happens.
        bad_rows: what to do with a row the collate function cannot load (:mod:`lit_trainer.data.bad_rows`: the
            collate function is then a ``GuardedCollate``): a window's batches are built before its first one is
            yielded, so a bad row stops the run at an optimizer-step boundary (``BadRows.fail``), and the rows a
            batch skipped are counted in :attr:`skipped_rows`. None: errors are raised as they are.
        **loader_options: the inner ``DataLoader``'s :class:`LoaderOptions`: ``num_workers`` (workers),
            ``pin_memory`` (pin host memory), ``persistent_workers`` (keep workers alive between epochs) and
            ``prefetch_factor`` (batches prefetched per worker), the last two requiring ``num_workers > 0``.

    Example::

        loader = TrainLoader(ds, ShardedBatchSampler(len(ds), 8), collate, count_items=count_target_tokens)
        for batch in loader:
            batch["num_items_in_batch"]  # target tokens of this micro-batch's accumulation window (this rank)
    """

    def __init__(
        self,
        dataset: DatasetSource,
        batch_sampler: BatchSampler,
        collate_fn: Callable[[list[dict[str, Any]]], dict[str, Any]],
        *,
        count_items: Callable[[dict[str, Any]], int | torch.Tensor] | None = None,
        accumulate_grad_batches: int = 1,
        windows: Callable[[], StepWindows] | None = None,
        seed: int = 0,
        bad_rows: BadRows | None = None,
        **loader_options: Unpack[LoaderOptions],
    ) -> None:
        if accumulate_grad_batches < 1:
            raise ValueError(f"`accumulate_grad_batches={accumulate_grad_batches}` is invalid: it must be >= 1.")
        self.batch_sampler, self.count_items = batch_sampler, count_items
        self.accumulate_grad_batches, self.windows, self.seed = accumulate_grad_batches, windows, seed
        self._consumed = 0  # micro-batches of the current epoch handed to the training loop: the checkpointed position
        self._restoring = False  # load_state_dict was called: the next iteration starts at the sampler's position
        self._generator = torch.Generator()
        self._source = _source(dataset)
        self.bad_rows = bad_rows

        def build(data: Dataset) -> DataLoader:
            return inner_loader(
                data, collate_fn, loader_options, batch_sampler=batch_sampler, generator=self._generator
            )

        self._build, self._collate_fn = build, collate_fn
        self._inner = build(self._source())  # the options are checked now, not at the first batch

    @property
    def dataset(self) -> Dataset:
        """The dataset the next iteration reads (the source's current one)."""
        return self._source()

    def _current_inner(self) -> DataLoader:
        """The inner ``DataLoader`` over the source's current dataset, rebuilt when the source hands out another."""
        self._inner = _rebuilt(self._inner, self._inner.dataset, self._source(), self._build)
        return self._inner

    @property
    def skipped_rows(self) -> int | None:
        """Rows skipped since this loader was built (``skip_bad_rows=True``), None when bad rows are not skipped."""
        return self.bad_rows.skipped_rows if self.bad_rows is not None else None

    @property
    def sampler(self) -> TrainLoader:
        """Lightning calls ``loader.sampler.set_epoch(e)`` at every epoch start; route it to :meth:`set_epoch`."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (in the sampler); a pending resume position only applies to the epoch it was saved in."""
        self.batch_sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The sampler's current epoch."""
        return int(self.batch_sampler.state_dict()["epoch"])

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, start = self._start()
        self._generator.manual_seed(self.seed + epoch)
        # a mid-window resume re-reads (does not yield) the window's trained micro-batches: the count is the window's
        replay = start - self._current_windows().bounds(start)[0] if self.count_items is not None and start else 0
        self.batch_sampler.load_state_dict({"epoch": epoch, "position": start - replay})  # seek
        self._consumed = start - replay
        batches = iter(self._current_inner())
        while True:
            # the window is read when it starts (after Lightning's epoch-start hooks)
            _, stop = self._current_windows().bounds(self._consumed)
            chunk = self._window(batches, stop - self._consumed)
            if not chunk:
                return
            if self.count_items is not None:
                count = window_count([self.count_items(batch) for batch in chunk])
                for batch in chunk:
                    batch[NUM_ITEMS_KEY] = count
            self._consumed += min(replay, len(chunk))
            for batch in chunk[replay:]:
                self._consumed += 1
                yield batch
            replay = 0

    def _window(self, batches: Iterator[dict[str, Any]], count: int) -> list[dict[str, Any]]:
        """The next ``count`` batches, built before the first of them trains: a bad row found here stops the run
        where the last optimizer step is finished and nothing of the next one is applied."""
        try:
            chunk = list(islice(batches, count))
        except Exception as error:
            if self.bad_rows is None or not isinstance(error, BadRowError):
                raise
            self.bad_rows.fail(error)
        return [self.bad_rows.take(batch) for batch in chunk] if self.bad_rows is not None else chunk

    def peek(self, epoch: int, index: int) -> dict[str, Any] | None:
        """The micro-batch this loader yields at position ``index`` of ``epoch``, collated in this process without
        moving the loader; None past the epoch's end or when the batch sampler cannot tell (it needs a
        ``batch_indices(epoch, index)`` method, as the GRPO prompt sampler has)."""
        locate = getattr(self.batch_sampler, "batch_indices", None)
        indices = locate(epoch, index) if locate is not None else None
        if indices is None:
            return None
        dataset = self.dataset
        batch = self._collate_fn([dataset[i] for i in indices])
        if isinstance(batch, dict):
            batch.pop(SKIPPED_KEY, None)  # counted when the loader yields it
        return batch

    def _start(self) -> tuple[int, int]:
        """``(epoch, first micro-batch)`` of the iteration that begins: the sampler's loaded position after
        :meth:`load_state_dict` (unless another epoch was selected since, which the sampler drops), else 0."""
        state = self.batch_sampler.state_dict()
        start = int(state["position"]) if self._restoring else 0
        self._restoring = False
        return int(state["epoch"]), start

    def _current_windows(self) -> StepWindows:
        if self.windows is not None:
            return self.windows()
        return StepWindows(self.accumulate_grad_batches)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the micro-batches of ``epoch`` already handed to the training loop."""
        return {"epoch": self.epoch, "position": self._consumed}

    @contextlib.contextmanager
    def saving_inside_a_batch(self) -> Iterator[None]:
        """While inside, :meth:`state_dict` leaves out the last micro-batch handed to the training loop: for a
        checkpoint written inside that micro-batch's training step (a stop inside a step,
        :mod:`lit_trainer.core.stop_request`, drops the step's partial work).

        Lightning resumes a checkpoint written inside a batch at its last *completed* batch (the progress counters'
        ``reset_on_restart``), so the batch in progress is trained again after the resume. Counted in the saved
        position, it was skipped instead: the resumed loader started one micro-batch later than Lightning's batch index,
        and every step from there on trained the next micro-batch's rows (GRPO at ``steps_per_generation=1``: the next
        round's prompts; at 2 the loader yields each generation batch twice in a row, which hid the shift).
        """
        in_progress = min(self._consumed, 1)
        self._consumed -= in_progress
        try:
            yield
        finally:
            self._consumed += in_progress

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration of epoch ``state["epoch"]`` starts at micro-batch ``state["position"]``.

        The state goes to the batch sampler, which holds it (and drops it if another epoch is selected first).
        """
        self.batch_sampler.load_state_dict({"epoch": int(state["epoch"]), "position": int(state["position"])})
        self._restoring = True


def _source(dataset: DatasetSource) -> Callable[[], Dataset]:
    """A loader's dataset as a function: a function is kept, a dataset is wrapped (a list or a dataset object is not
    callable)."""
    return dataset if callable(dataset) else lambda: dataset


def _rebuilt(inner: DataLoader, old: Any, new: Dataset, build: Callable[[Dataset], DataLoader]) -> DataLoader:
    """``inner`` when it still reads ``new`` (``old`` is what it reads), else ``build(new)``.

    Raises:
        ValueError: when ``new`` has another number of rows: the loader's batches were laid out for ``len(old)``.
    """
    if new is old:
        return inner
    if len(new) != len(old):
        raise ValueError(
            f"The loader's dataset changed from {len(old)} to {len(new)} rows after the loader was built: its batches "
            "were laid out for the old rows. Build a new loader (`trainer.fit` asks the data module again with "
            "`reload_dataloaders_every_n_epochs`), or keep the rows and change only their columns."
        )
    return build(new)


def window_count(counts: list[int | torch.Tensor]) -> torch.Tensor:
    """Sum of per-micro-batch counts (scalars, or 1-D tensors of several counts) as an int64 tensor."""
    return torch.stack([torch.as_tensor(c, dtype=torch.int64) for c in counts]).sum(0)


class LoaderOptions(TypedDict, total=False):
    """The ``DataLoader`` performance options of :class:`TrainLoader` and :class:`EvalLoader`, keyword only.

    ``num_workers`` (default 0: load in the main process), ``pin_memory`` (default False), ``persistent_workers``
    (default False; needs workers) and ``prefetch_factor`` (default None; needs workers, >= 1), as
    ``torch.utils.data.DataLoader`` takes them.
    """

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None


def inner_loader(
    dataset: Dataset, collate_fn: Callable[[list[dict[str, Any]]], Any], options: LoaderOptions, **sampling: Any
) -> DataLoader:
    """The ``DataLoader`` doing the loading inside a loader: the checked ``options`` plus the ``sampling`` arguments.

    Raises:
        TypeError: on an option that is not a :class:`LoaderOptions` key (named in the message).
        ValueError: as :func:`validate_loader_options`.
    """
    unknown = sorted(set(options) - set(LoaderOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"unknown loader option(s) {', '.join(unknown)}: the options are "
            f"{', '.join(LoaderOptions.__annotations__)}."
        )
    validate_loader_options(
        options.get("num_workers", 0), options.get("persistent_workers", False), options.get("prefetch_factor")
    )
    return DataLoader(dataset, collate_fn=collate_fn, **options, **sampling)


def validate_loader_options(num_workers: int, persistent_workers: bool, prefetch_factor: int | None) -> None:
    """Reject DataLoader option combinations early, with the fix in the message (as ``TrainingArguments`` does).

    Raises:
        ValueError: negative ``num_workers``; ``prefetch_factor`` or ``persistent_workers`` without workers;
            ``prefetch_factor < 1``.
    """
    if num_workers < 0:
        raise ValueError(f"`num_workers={num_workers}` is invalid: it must be >= 0 (0 loads in the main process).")
    if prefetch_factor is not None and num_workers == 0:
        raise ValueError(
            f"`prefetch_factor={prefetch_factor}` can only be set when data is loaded in worker processes: "
            "set `num_workers` > 0 or leave `prefetch_factor` unset."
        )
    if prefetch_factor is not None and prefetch_factor < 1:
        raise ValueError(f"`prefetch_factor={prefetch_factor}` is invalid: it must be >= 1.")
    if persistent_workers and num_workers == 0:
        raise ValueError("`persistent_workers=True` needs worker processes: set `num_workers` > 0 or turn it off.")


class EvalLoader:
    """Sequential evaluation batches over this rank's strided shard ``rank::num_replicas`` (no duplicates).

    Like :class:`TrainLoader`, it is not a ``DataLoader``, so Lightning does not inject a ``DistributedSampler``
    (which would repeat samples to even out ranks and bias the metrics). Ranks may get one batch more or less; the
    evaluation loop has no gradient sync, and the metrics are reduced once at the end.

    ``dataset`` may be a function returning the dataset, called when each iteration starts (as :class:`TrainLoader`).
    """

    def __init__(
        self,
        dataset: DatasetSource,
        batch_size: int,
        collate_fn: Callable[[list[dict[str, Any]]], dict[str, Any]],
        *,
        num_replicas: int = 1,
        rank: int = 0,
        **loader_options: Unpack[LoaderOptions],
    ) -> None:
        self._source = _source(dataset)

        def build(data: Dataset) -> DataLoader:
            shard = Subset(data, range(rank, len(data), num_replicas))
            return inner_loader(shard, collate_fn, loader_options, batch_size=batch_size, shuffle=False)

        self._build = build
        self._inner = build(self._source())

    def _current_inner(self) -> DataLoader:
        self._inner = _rebuilt(self._inner, self._inner.dataset.dataset, self._source(), self._build)
        return self._inner

    @property
    def dataset(self) -> Subset:
        """This rank's rows of the source's current dataset."""
        return self._current_inner().dataset

    def __len__(self) -> int:
        return len(self._current_inner())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # a generator: the dataset is read (and workers start) at the first batch, after the hooks that run between
        # Lightning's `iter()` and it (`on_validation_start` precomputes the reference log-probs of a `validate`)
        yield from self._current_inner()
