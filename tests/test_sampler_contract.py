"""The batch-sampler contract: the Protocol, the one registry, the one resume position, a user-defined sampler."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import get_args

import pytest
import torch
from datasets import Dataset

from lit_trainer.data.loader import TrainLoader
from lit_trainer.data.prompt import GenerationBatchSampler
from lit_trainer.data.samplers.batch_sampler import BatchSampler, EpochPosition, ShardedBatchSampler
from lit_trainer.data.samplers.repeat_sampler import RepeatSampler
from lit_trainer.data.samplers.sampling import SAMPLERS, Sampling, make_batch_sampler
from lit_trainer.data.sft import SFTDataModule

ROWS = [{"x": i} for i in range(12)]


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([r["x"] for r in rows])}


def _xs(loader) -> list[list[int]]:
    return [b["x"].tolist() for b in loader]


class ReversedPairs:
    """A user-written sampler satisfying the Protocol from scratch (no lit_trainer base class): pairs of indices,
    last first, rotated by the epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.position, self.start = n, 0, 0, 0

    def _batches(self) -> list[list[int]]:
        order = list(range(self.n))[::-1]
        order = order[self.epoch % self.n :] + order[: self.epoch % self.n]
        return [order[i : i + 2] for i in range(0, self.n, 2)]

    def __iter__(self) -> Iterator[list[int]]:
        start, self.start = self.start, 0
        for position, batch in enumerate(self._batches()[start:], start=start + 1):
            self.position = position
            yield batch

    def __len__(self) -> int:
        return len(self._batches())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = self.start = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.start = self.position


class EveryThird(EpochPosition):
    """The "Adding a sampler" recipe of docs/resume.md: only `_iter_from` and `__len__` are written."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _iter_from(self, start: int) -> Iterator[list[int]]:
        batches = [[i, (i + self.epoch) % self.n] for i in range(0, self.n, 3)]
        return iter(batches[start:])

    def __len__(self) -> int:
        return len(range(0, self.n, 3))


# --------------------------------------------------------------------------------------------------- the registry


def test_registry_and_literal_list_the_same_strategies():
    assert set(SAMPLERS) == set(get_args(Sampling)) == {"random", "sequential", "group_by_length", "batch_rebalance"}


@pytest.mark.parametrize("sampling", get_args(Sampling))
def test_every_registered_strategy_builds_a_batch_sampler(sampling):
    sampler = make_batch_sampler(
        sampling,
        num_samples=12,
        lengths=lambda: list(range(1, 13)),
        batch_size=2,
        seed=0,
        num_replicas=2,
        rank=1,
        accumulate_grad_batches=2,
    )
    assert isinstance(sampler, BatchSampler)
    sampler.set_epoch(1)
    batches = list(sampler)
    assert len(batches) == len(sampler) > 0 and all(isinstance(i, int) for b in batches for i in b)


def test_unknown_sampling_names_every_choice(tokenizer):
    with pytest.raises(ValueError, match="sampling='bogus'") as err:
        make_batch_sampler("bogus", num_samples=4, lengths=list, batch_size=1, seed=0, num_replicas=1, rank=0)
    assert all(repr(name) in str(err.value) for name in get_args(Sampling))
    with pytest.raises(ValueError, match="sampling='bogus'") as err:
        SFTDataModule(tokenizer=tokenizer, sampling="bogus")
    assert all(repr(name) in str(err.value) for name in get_args(Sampling))


def test_generation_and_repeat_samplers_follow_the_protocol():
    repeat = RepeatSampler(8, mini_repeat_count=2, batch_size=4, repeat_count=2, seed=1)
    assert isinstance(GenerationBatchSampler(repeat, rows=4), BatchSampler)
    assert isinstance(repeat, EpochPosition)
    assert not isinstance(object(), BatchSampler)


# --------------------------------------------------------------------------------------- a user-defined sampler


@pytest.mark.parametrize("make", [lambda: ReversedPairs(12), lambda: EveryThird(12)], ids=["protocol", "base"])
def test_a_user_sampler_plugs_into_the_loader_and_resumes(make):
    assert isinstance(make(), BatchSampler)
    full = TrainLoader(ROWS, make(), _collate, count_items=lambda b: len(b["x"]), accumulate_grad_batches=2)
    full.set_epoch(2)
    expected = _xs(full)
    assert expected == [list(b) for b in _epoch_batches(make(), 2)]  # the loader yields the sampler's order
    first = TrainLoader(ROWS, make(), _collate, count_items=lambda b: len(b["x"]), accumulate_grad_batches=2)
    first.set_epoch(2)
    head = [b["x"].tolist() for b in itertools.islice(iter(first), 3)]  # stops inside the second window
    state = first.state_dict()
    assert state == {"epoch": 2, "position": 3}
    resumed = TrainLoader(ROWS, make(), _collate, count_items=lambda b: len(b["x"]), accumulate_grad_batches=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # Lightning announces the same epoch again: the position stays
    assert head + _xs(resumed) == expected


def _epoch_batches(sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_a_data_module_takes_a_user_sampler(tokenizer):
    class Custom(SFTDataModule):
        def train_batch_sampler(self) -> BatchSampler:
            return ReversedPairs(len(self.train_dataset))

    dm = Custom(tokenizer=tokenizer, dataset=Dataset.from_dict({"text": [f"r{i}" for i in range(6)]}), val_size=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader.batch_sampler, ReversedPairs)
    first = next(iter(loader))["input_ids"]
    assert first[0].tolist()[:2] == [ord("r") + 3, ord("5") + 3]  # row 5 first: the custom order reached the loader


# ----------------------------------------------------------------------------------------- one resume position


def _loader(sampler=None, **kw) -> TrainLoader:
    return TrainLoader(ROWS, sampler or ShardedBatchSampler(12, 2, seed=3), _collate, **kw)


def test_the_sampler_holds_the_loaded_position():
    loader = _loader()
    loader.load_state_dict({"epoch": 1, "position": 4})
    assert loader.batch_sampler.state_dict() == {"epoch": 1, "position": 4}
    assert loader.epoch == 1
    loader.set_epoch(2)  # another epoch drops it, in the sampler
    assert loader.batch_sampler.state_dict() == {"epoch": 2, "position": 0}
    assert len(_xs(loader)) == 6


def test_a_checkpoint_of_the_previous_version_resumes():
    # the loader state Lightning saved before this change: {"epoch", "position"} in micro-batches of this rank
    old_layout = {"epoch": 3, "position": 2}
    full = _loader()
    full.set_epoch(3)
    expected = _xs(full)
    resumed = _loader()
    resumed.load_state_dict(old_layout)
    assert _xs(resumed) == expected[2:]
    assert resumed.state_dict() == {"epoch": 3, "position": 6}


def test_an_abandoned_epoch_restarts_from_its_first_batch():
    # the DataLoader ran the sampler ahead of training; a new iteration without a resume starts the epoch over
    loader = _loader(num_workers=0)
    loader.set_epoch(1)
    list(itertools.islice(iter(loader), 2))
    assert _xs(loader) == _epoch_batches(ShardedBatchSampler(12, 2, seed=3), 1)


def test_a_position_beyond_the_epoch_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"`position=7` is out of range for an epoch of 6 .*same settings"):
        _loader().load_state_dict({"epoch": 0, "position": 7})
