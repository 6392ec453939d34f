"""Batching: an SFTDataModule subclass whose first epochs run from the shortest rows to the longest."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lit_trainer.data import SFTDataModule
from lit_trainer.data.samplers import EpochPosition


class CurriculumSampler(EpochPosition):
    """This rank's micro-batches: rows sorted by length (shortest first) in the first ``epochs`` epochs, shuffled
    with ``seed + epoch`` after. The order depends on (seed, epoch, rank) only and every rank yields ``len(self)``
    batches (the incomplete last round is dropped), so resume stays exact and DDP ranks stay in step.
    ``EpochPosition`` adds the resume position (``set_epoch``, ``state_dict``, ``load_state_dict``)."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, world: int, rank: int, epochs: int) -> None:
        self.lengths, self.batch_size, self.seed = list(lengths), batch_size, seed
        self.num_replicas, self.rank, self.curriculum_epochs = world, rank, epochs

    def __len__(self) -> int:
        return len(self.lengths) // (self.batch_size * self.num_replicas)

    def _iter_from(self, start: int) -> Iterator[list[int]]:
        if self.epoch < self.curriculum_epochs:
            order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        else:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.lengths), generator=generator).tolist()
        size, rounds = self.batch_size, len(self)
        batches = [order[i : i + size] for i in range(0, rounds * size * self.num_replicas, size)]
        return iter(batches[self.rank :: self.num_replicas][start:])


class CurriculumSFTDataModule(SFTDataModule):
    """SFTDataModule with a length curriculum; every other option is SFTDataModule's."""

    def __init__(self, *args: Any, curriculum_epochs: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # every __init__ argument is saved in self.hparams

    def train_batch_sampler(self) -> CurriculumSampler:
        hp, trainer = self.hparams, self.trainer
        world, rank = trainer.world_size, trainer.global_rank
        return CurriculumSampler(self.lengths(), hp.batch_size, hp.seed, world, rank, hp.curriculum_epochs)
