"""RewardModule on 2 CPU ranks (one launch of ``tests/scripts/reward_ranks.py``) against one process.

DDP with accumulation: each optimizer step's gradient (after the all-reduce) is the mean over all the pairs of the
step, on both ranks and across micro-batches, including a short last window (one micro-batch per rank), checked
against the full-batch gradient of those pairs. FSDP2 (``ModelParallelStrategy``): the sharded fit ends with the
weights of the one-process fit on the same global batches (per-device batch 2 x 2 ranks = batch 4 on one device).

Tolerances are calibrated on the machine that runs the test (``tests/helpers/rounding.py``): the full-batch gradient
and the one-process fit are repeated in float64, and a float32 result computed in another order (other ranks, other
micro-batches) must land within a small multiple of how far float32 lands from float64, and at least 100 times below
a real mistake (a pair lost; one optimizer step's change of the weights).
"""

from __future__ import annotations

from pathlib import Path

import _fsdp_common as common  # tests/scripts
import pytest
import torch
from reward_common import datamodule, reward_model, reward_module

from helpers.accumulation import calibrated
from helpers.rounding import Rounding, relative_l2
from lit_trainer.losses import reward_loss

pytestmark = pytest.mark.ddp


@pytest.fixture(scope="module")
def run(ddp_world) -> Path:
    return ddp_world.part("reward_ranks")  # tests/scripts/reward_ranks.py


def _gradient(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradient of the mean over the batch's pairs, in one forward."""
    model.zero_grad()
    chosen, rejected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.chunk(2)
    reward_loss(chosen.squeeze(-1), rejected.squeeze(-1), center_rewards_coefficient=0.01).mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_ddp_accumulated_gradient_is_the_mean_over_the_steps_pairs(run: Path):
    ranks = [torch.load(run / f"ddp_rank{r}.pt", weights_only=False) for r in (0, 1)]
    dm = datamodule(12, 2)
    dm.setup("fit")
    index = {tuple(row["prompt_ids"] + row["chosen_ids"]): i for i, row in enumerate(dm.train_dataset)}

    def pairs_of(micro_batches: list[torch.Tensor]) -> list[int]:
        rows = [r[r != dm.pad_token_id].tolist() for ids in micro_batches for r in ids[: len(ids) // 2]]
        return [index[tuple(r)] for r in rows]

    model = reward_model()
    assert [len(r["seen"]) for r in ranks] == [3, 3] and [len(r["grads"]) for r in ranks] == [2, 2]
    windows = [slice(0, 2), slice(2, 3)]  # 2 micro-batches per rank, then the short window of 1
    seen = []
    for step, window in enumerate(windows):
        pairs = sorted(p for r in ranks for p in pairs_of(r["seen"][window]))
        seen += pairs
        rows = [dm.train_dataset[i] for i in pairs]
        mistake = lambda m, rows=rows: _gradient(m, dm._collate(rows[:-1], True))  # a pair lost
        reference = calibrated(lambda m, rows=rows: _gradient(m, dm._collate(rows, True)), model, mistake=mistake)
        for r in ranks:
            reference.check(r["grads"][step])
    assert sorted(seen) == list(range(12))  # every pair once


def test_fsdp_matches_one_process(run: Path):
    sharded = torch.load(run / "fsdp.pt", weights_only=False)
    assert sharded["param_type"] == "DTensor"

    def single(precision: str) -> dict[str, torch.Tensor]:
        module = reward_module(learning_rate=1e-3)
        common.trainer("auto", 1, common.DPO_STEPS, [], precision=precision).fit(module, datamodule=datamodule(16, 4))
        return common.full_weights(module)

    weights = single("32-true")
    initial = dict(reward_model().named_parameters())
    step = relative_l2(weights, initial) / common.DPO_STEPS
    Rounding.of(weights, single("64-true"), what="reward weights").check(sharded["weights"], weights, mistake=step)
