"""TrainLoader and EvalLoader share one set of DataLoader performance options (LoaderOptions)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from lit_trainer.data.loader import EvalLoader, TrainLoader
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler

ROWS = [{"x": torch.tensor(i)} for i in range(6)]
OPTIONS = {"num_workers": 2, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 3}


def _train(**options):
    return TrainLoader(ROWS, ShardedBatchSampler(6, 2, seed=0), default_collate, **options)


def _eval(**options):
    return EvalLoader(ROWS, 2, default_collate, **options)


@pytest.mark.parametrize("make", [_train, _eval])
def test_options_reach_the_inner_dataloader(make) -> None:
    inner = make(**OPTIONS)._inner  # built, not iterated: no worker starts
    assert (inner.num_workers, inner.pin_memory, inner.persistent_workers, inner.prefetch_factor) == (2, True, True, 3)
    default = make()._inner
    assert (default.num_workers, default.pin_memory, default.persistent_workers, default.prefetch_factor) == (
        0, False, False, None,
    )  # fmt: skip


@pytest.mark.parametrize("make", [_train, _eval])
def test_unknown_and_invalid_options_are_refused(make) -> None:
    with pytest.raises(TypeError, match=r"unknown loader option\(s\) workers: the options are num_workers"):
        make(workers=2)
    with pytest.raises(ValueError, match=r"`persistent_workers=True` needs worker processes"):
        make(persistent_workers=True)
