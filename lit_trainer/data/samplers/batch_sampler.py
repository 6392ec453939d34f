"""The batch-sampler contract (:class:`BatchSampler`), its one resume position (:class:`EpochPosition`), and the
rank-aware, epoch-seeded :class:`ShardedBatchSampler` of ``sampling: random | sequential``.

Every training batch sampler used by :class:`~lit_trainer.data.loader.TrainLoader` satisfies :class:`BatchSampler`.
The samplers of this package get the position part of it from :class:`EpochPosition`, which is the only place that
tracks where an epoch stands: the loader keeps no epoch and no skip of its own, it seeks the sampler with
``load_state_dict`` (see ``docs/resume.md``). The built-in strategies are registered by name in
:mod:`lit_trainer.data.samplers.sampling`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch


@runtime_checkable
class BatchSampler(Protocol):
    """What :class:`~lit_trainer.data.loader.TrainLoader` needs from a training batch sampler.

    * iterating yields THIS rank's micro-batches (lists of dataset indices) for the current epoch;
    * ``len()`` is the number of micro-batches this rank yields per epoch, equal on every rank (so DDP never hangs);
    * ``set_epoch(e)`` selects the epoch; the order must be a pure function of ``(seed, epoch, rank)``, never of a
      global RNG, so that a resumed run sees the same order. Selecting ANOTHER epoch drops a pending resume;
    * ``state_dict()`` returns ``{"epoch", "position"}``; right after ``load_state_dict(state)`` it returns ``state``;
    * ``load_state_dict({"epoch", "position"})`` makes the NEXT iteration yield epoch ``epoch`` from micro-batch
      ``position`` on (once; later iterations start at 0). The loader uses it to seek at every epoch start.

    Subclassing :class:`EpochPosition` and writing ``_iter_from(start)`` and ``__len__`` gives all of it.
    """

    def __iter__(self) -> Iterator[list[int]]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: Mapping[str, int]) -> None: ...


class EpochPosition:
    """The resume position of a sampler, in one place: ``epoch``, ``position`` and where the next iteration starts.

    A subclass writes ``_iter_from(start)`` (the epoch's items from item ``start`` on, for ``self.epoch``) and
    ``__len__``; iterating, ``set_epoch``, ``state_dict`` and ``load_state_dict`` are implemented here once.
    ``position`` counts the items (indices or micro-batches) yielded in the current epoch; a loaded position is
    consumed by the next iteration, which starts at it. After a whole epoch, ``position`` is 0 again (the next
    iteration starts the epoch over) unless the class sets ``_rewind_at_epoch_end = False``, in which case it stays
    at ``len()``: the state then says the whole epoch was yielded.
    """

    epoch: int = 0
    position: int = 0
    _resume_at: int = 0
    _rewind_at_epoch_end: ClassVar[bool] = True

    def __len__(self) -> int:
        raise NotImplementedError

    def _iter_from(self, start: int) -> Iterator[Any]:
        """The items of epoch ``self.epoch`` from item ``start`` on (``start <= len(self)``)."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        start, self._resume_at = self._resume_at, 0
        self.position = start
        for item in self._iter_from(start):
            self.position += 1
            yield item
        if self._rewind_at_epoch_end:
            self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields; another epoch than the current one drops a pending
        resume position (a checkpoint taken at the end of an epoch resumes at the start of the next one)."""
        if epoch != self.epoch:
            self.position = self._resume_at = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the items already yielded in this epoch (or the loaded position)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume: the next iteration yields epoch ``state["epoch"]`` from item ``state["position"]`` on.

        Raises:
            ValueError: when the position is outside ``[0, len(self)]`` (the data or batch size changed).
        """
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(
                f"`position={position}` is out of range for an epoch of {len(self)} items of {type(self).__name__}: "
                "the checkpoint was written with other data, batch size or world size. Resume with the same settings "
                "or start a new run."
            )
        self.epoch = int(state["epoch"])
        self.position = self._resume_at = position


class ShardedBatchSampler(EpochPosition):
    """Shuffled (or sequential) micro-batches, dealt round-robin to ranks.

    The epoch's index order is ``randperm(n)`` from a generator seeded with ``seed + epoch`` (or ``range(n)`` when
    ``shuffle=False``); it is cut into global batches of ``batch_size``, and batch ``j`` goes to rank
    ``j % num_replicas``. When the number of batches is not a multiple of ``num_replicas``, the last round is
    completed by re-using the first indices of the epoch (like ``DistributedSampler``) unless ``drop_last=True``, so
    every rank yields the same number of micro-batches.

    Args:
        num_samples: dataset size.
        batch_size: micro-batch size per rank.
        shuffle: shuffle with ``seed + epoch``.
        seed: base seed.
        num_replicas: world size (default: the initialised process group, else 1).
        rank: this rank (default: the initialised process group, else 0).
        drop_last: drop the incomplete last batch and the incomplete last round of batches.

    Raises:
        ValueError: on an empty dataset, ``batch_size < 1`` or a rank outside ``[0, num_replicas)``.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        num_replicas, rank = resolve_replicas(num_replicas, rank)
        if num_samples < 1:
            raise ValueError("The training dataset is empty: there is nothing to sample. Check the data source.")
        if batch_size < 1:
            raise ValueError(f"`batch_size={batch_size}` is invalid: it must be >= 1.")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last

    def _global_batches(self) -> list[list[int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and len(batches[-1]) < self.batch_size:
            batches.pop()
        rounds, leftover = divmod(len(batches), self.num_replicas)
        if leftover and self.drop_last:
            return batches[: rounds * self.num_replicas]
        if leftover:
            # complete the last round with the first indices of the epoch (wrapping as often as needed)
            need = self.num_replicas - leftover
            flat = [i for batch in batches[:need] for i in batch] or order
            reps = math.ceil(need * self.batch_size / len(flat))
            pool = (flat * reps)[: need * self.batch_size]
            batches += [pool[k * self.batch_size : (k + 1) * self.batch_size] for k in range(need)]
        return batches

    def _iter_from(self, start: int) -> Iterator[list[int]]:
        return iter(self._global_batches()[self.rank :: self.num_replicas][start:])

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        batches = full + (1 if rest and not self.drop_last else 0)
        return batches // self.num_replicas if self.drop_last else math.ceil(batches / self.num_replicas)


def resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Default ``num_replicas``/``rank`` to the initialised process group (1 and 0 without one) and validate them."""
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if num_replicas is None:
        num_replicas = torch.distributed.get_world_size() if initialised else 1
    if rank is None:
        rank = torch.distributed.get_rank() if initialised else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(
            f"`num_replicas={num_replicas}, rank={rank}` is invalid: need num_replicas >= 1 and "
            "0 <= rank < num_replicas."
        )
    return num_replicas, rank
