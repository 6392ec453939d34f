"""Exact replay of a plain ``torch.utils.data.DataLoader`` epoch, for :class:`~lit_trainer.callbacks.ExactResume`.

A plain ``DataLoader`` has no position to save, and its randomness comes from the RNG when an epoch's iterator is
built: the iterator draws the workers' base seed from the global torch RNG (or the loader's ``generator``), and a
``RandomSampler`` without a generator draws its permutation seed from it at the first batch. Lightning builds the
iterator before any resume hook runs, so restoring the RNG "at the first batch" is too late for the order.

:class:`ReplayLoader` wraps such a loader (ExactResume swaps it into the fit loop) and builds each epoch's iterator
lazily, at the epoch's first batch. It records the RNG states at that moment (global generators and the loader's own
``torch.Generator`` objects), so a checkpoint holds what built the epoch. On resume, ExactResume puts those states
back before the interrupted epoch's iterator is built, so the same permutation and worker seeds come out, and the
batches already trained are skipped by index (:func:`skipping_copy`), as the HF Trainer's ``skip_first_batches``
does: no skipped sample is loaded. The wrapper looks stateful to Lightning (so it does not warn that the loader cannot
resume) but keeps no state of its own; ExactResume removes its marker from the checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from itertools import islice
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

REPLAY_MARKER = "lit_trainer_exact_resume_replay"


class ReplayOwner(Protocol):
    """What a :class:`ReplayLoader` asks of the callback that installed it (``ExactResume``): this module does not
    import the callback, so the two files do not import each other."""

    def _begin_replay_epoch(self, replay: ReplayLoader) -> int:
        """Put back the states that built this epoch on a resume; return the number of batches to skip."""

    def _current_epoch(self) -> int:
        """The trainer's current epoch."""

    def _capture_loader_states(self, loader: DataLoader) -> dict[str, Any]:
        """The RNG states that build ``loader``'s epoch iterator, now."""


class _SkipFirst:
    """An index sampler (sampler or batch sampler) without its first ``skip`` elements (index lists only)."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Iterator[Any]:
        return islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


def loader_generators(loader: DataLoader) -> list[torch.Generator]:
    """The dedicated ``torch.Generator`` objects that drive ``loader``'s randomness (its own, its sampler's, its batch
    sampler's sampler's), without duplicates; the global generators are saved separately."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
    found = {id(g): g for g in (getattr(h, "generator", None) for h in holders) if isinstance(g, torch.Generator)}
    return list(found.values())


def skipping_copy(loader: DataLoader, skip: int) -> DataLoader:
    """A shallow copy of ``loader`` whose index sampler drops the first ``skip`` batches before anything is loaded.

    The copy keeps the loader's class, dataset, collate function, workers and generators (HF's
    ``skip_first_batches`` rebuilds a plain ``DataLoader`` instead). ``DataLoader`` forbids setting its samplers after
    construction, so the copy's attributes are set through ``vars``; the copy only serves the rest of one epoch, so its
    workers are not persistent.
    """
    clone = copy.copy(loader)
    attrs = vars(clone)
    key = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    attrs[key] = _SkipFirst(getattr(loader, key), skip)
    attrs["_iterator"] = None
    attrs["persistent_workers"] = False
    return clone


def can_skip_by_index(loader: DataLoader) -> bool:
    """Map-style datasets are skipped by index; an iterable dataset has to be read to move forward."""
    return not isinstance(loader.dataset, IterableDataset)


class ReplayLoader:
    """A plain training ``DataLoader`` whose epochs ExactResume can rebuild exactly (see the module docstring).

    Attribute access falls through to the wrapped loader (``trainer.train_dataloader.dataset`` keeps working), and
    Lightning's per-epoch ``sampler.set_epoch`` reaches the wrapped loader's sampler.
    """

    def __init__(self, loader: DataLoader, owner: ReplayOwner, index: int) -> None:
        self.loader, self.owner, self.index = loader, owner, index
        self.epoch: int | None = None
        self.epoch_start: dict[str, Any] | None = None  # states that built the current epoch's iterator

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return self._epoch()

    def _epoch(self) -> Iterator[Any]:
        skip = self.owner._begin_replay_epoch(self)  # restores the states that built this epoch on a resume
        self.epoch, self.epoch_start = self.owner._current_epoch(), self.owner._capture_loader_states(self.loader)
        if skip == 0:
            yield from self.loader
        elif can_skip_by_index(self.loader):
            yield from skipping_copy(self.loader, skip)
        else:
            yield from islice(iter(self.loader), skip, None)  # read and dropped: an iterable stream has no index

    # Lightning saves and restores stateful training loaders; this one has nothing to restore, and looking stateful
    # keeps Lightning from warning that a mid-epoch resume replays the epoch from its first batch
    def state_dict(self) -> dict[str, Any]:
        return {REPLAY_MARKER: True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
