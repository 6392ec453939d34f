"""2-process DDP fit (CPU, gloo) with ``BatchRebalanceSampler`` and ``accumulate_grad_batches=2``.

The script ``tests/scripts/ddp_batch_rebalance.py`` records, per rank, the dataset indices of every micro-batch and,
on rank 0, the gradient of every optimizer step next to a full-batch token-mean gradient on the union of the step's
samples over both ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import ddp_batch_rebalance as script  # tests/scripts: constants and the row lengths, nothing runs on import
import pytest
import torch

from lit_trainer.data.samplers.rebalance_sampler import BatchRebalanceSampler

pytestmark = pytest.mark.ddp


@pytest.fixture(scope="module")
def run(ddp_world) -> Path:
    return ddp_world.part("batch_rebalance")  # tests/scripts/ddp_batch_rebalance.py


def test_lightning_leaves_the_loader_alone_and_ranks_train_their_own_batches(run: Path):
    ranks = [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]
    n, bs, accum = script.N_ROWS, script.BATCH_SIZE, script.ACCUMULATE
    for r, facts in enumerate(ranks):
        # not wrapped, not re-instantiated: the very TrainLoader the module returned, our rank-aware sampler
        assert facts["loader_untouched"] and facts["loader_type"] == "TrainLoader"
        assert facts["sampler_type"] == "BatchRebalanceSampler"
        assert (facts["world_size"], facts["sampler_replicas"], facts["sampler_rank"]) == (2, 2, r)
        # 26 rows, step of 3*2*2 = 12: 2 full steps + a tail of 2 -> 1 micro-batch per rank: 5 per epoch, 3 steps
        assert facts["global_step"] == 3 * script.EPOCHS
    for epoch in range(script.EPOCHS):
        union = []
        for r, facts in enumerate(ranks):
            got = [rec["idx"] for rec in facts["records"] if rec["epoch"] == epoch]
            expected = BatchRebalanceSampler(
                script.row_lengths(), bs, num_replicas=2, rank=r, accumulate_grad_batches=accum, seed=script.SEED
            )
            expected.set_epoch(epoch)
            assert got == list(expected)  # exactly this rank's own micro-batches, in order
            assert [rec["step"] for rec in facts["records"] if rec["epoch"] == epoch] == [
                3 * epoch + s for s in (0, 0, 1, 1, 2)
            ]
            union += [i for mb in got for i in mb]
        assert sorted(union) == list(range(n))  # the union over ranks is the epoch, each row once
    epochs = [[rec["idx"] for rec in ranks[0]["records"] if rec["epoch"] == e] for e in range(script.EPOCHS)]
    assert epochs[0] != epochs[1]  # set_epoch reached the sampler


def test_step_gradient_equals_full_batch_token_mean_gradient(run: Path):
    results = torch.load(run / "grads.pt", weights_only=True)
    assert len(results) == 3 * script.EPOCHS
    sizes = []
    for res in results:
        sizes.append(len(res["union"]))
        for got, full in zip(res["grads"], res["full"]):
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)
    assert sizes == [12, 12, 2] * script.EPOCHS  # the short last window is token-exact too
