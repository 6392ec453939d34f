"""2-process DDP GRPO on CPU (gloo): see ``tests/scripts/ddp_grpo.py`` for the geometry and what is recorded."""

from __future__ import annotations

import json
from pathlib import Path

import ddp_grpo as script  # tests/scripts: constants and helpers; nothing runs on import
import pytest
import torch
from test_grpo_module import step_reference

from helpers.rounding import Rounding, relative_l2

pytestmark = pytest.mark.ddp


@pytest.fixture(scope="module")
def run(ddp_world) -> Path:
    return ddp_world.part("grpo")  # tests/scripts/ddp_grpo.py


def _facts(run: Path, phase: str) -> list[dict]:
    return [json.loads((run / f"{phase}_rank{r}.json").read_text()) for r in (0, 1)]


def _tensors(run: Path, phase: str) -> list[dict]:
    return [torch.load(run / f"{phase}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_each_rank_generates_for_its_own_prompts(run: Path):
    facts = _facts(run, "full")
    prompts = script.prompt_texts()
    for r, f in enumerate(facts):
        assert (f["world_size"], f["sampler_rank"], f["loader"], f["global_step"]) == (2, r, "TrainLoader", 4)
        assert len(f["calls"]) == 2  # 4 optimizer steps, a round = spg 4 micro-steps = 2 optimizer steps
    for k in range(2):
        # round k: prompts 3k..3k+2 (sequential order), 8 copies each, 24 rows cut in two contiguous halves of 12
        expected = [p for p in prompts[3 * k : 3 * k + 3] for _ in range(8)]
        assert facts[0]["calls"][k] == expected[:12] and facts[1]["calls"][k] == expected[12:]


def _group_advantages(rewards: torch.Tensor, size: int = 8) -> torch.Tensor:
    """Independent reference: (r - group mean) / (Bessel group std + 1e-4), groups of ``size`` consecutive rows."""
    out = []
    for group in rewards.reshape(-1, size):
        mean = group.sum() / size
        std = ((group - mean) ** 2).sum().div(size - 1).sqrt()
        out.append((group - mean) / (std + 1e-4))
    return torch.cat(out)


def test_advantages_use_the_rewards_gathered_over_ranks(run: Path):
    ranks = _tensors(run, "full")
    first = [t["rounds"][0] for t in ranks]
    ids = [row[m.bool()].tolist() for f in first for row, m in zip(f["ids"], f["mask"])]  # rank 0 rows, then rank 1
    rewards = torch.tensor(script.length_reward([], [], ids))
    expected = _group_advantages(rewards)
    got = torch.cat([f["advantages"] for f in first])
    # tolerance: the reference's float32 rounding against its float64 twin (helpers/rounding.py); a real mistake,
    # the split group (rows 8-15) normalised by each rank's own four rows, must lie 100 bounds away
    rounding = Rounding.of({"a": expected}, {"a": _group_advantages(rewards.double())}, what="advantages")
    local = torch.cat([expected[:8], _group_advantages(rewards[8:16], 4), expected[16:]])
    rounding.check({"a": got}, {"a": expected}, mistake=relative_l2({"a": local}, {"a": expected}))
    # prompt 1's group (rows 8-15) is split: rank 0's last four rows and rank 1's first four
    assert first[0]["ids"].shape[0] == 12 and first[1]["ids"].shape[0] == 12
    assert rewards[8:16].std() > 0  # the split group has a signal, so gathering matters
    # tolerance (allclose's rtol 1e-5): the logged mean is an all-reduced float32 sum over ranks, rewards.mean() sums
    # in one process; the rewards are small integers, so only the final division rounds (~1e-7 relative)
    assert torch.allclose(first[0]["reward"], rewards.mean()) and torch.allclose(first[1]["reward"], rewards.mean())


def test_synced_step_gradient_equals_the_full_batch_token_mean_gradient(run: Path):
    ranks = _tensors(run, "full")
    # step 0 used slices 0 and 1 of each rank's buffer (accumulate 2): 2 x 3 rows per rank, 12 rows in all
    assert all(s["advantages"].shape[0] == script.BATCH for t in ranks for s in t["step0"]["slices"][:2])
    slices = [s for t in ranks for s in t["step0"]["slices"][:2]]
    # dapo, on-policy, temperature 1, row by row; tolerance calibrated by its float64 twin, a real mistake a row lost
    reference = step_reference(script.build_model(), slices, "dapo", 1.0)
    for t in ranks:
        reference.check(t["step0"]["grads"])
    # DDP keeps the replicas identical: the same all-reduced gradient, the same optimizer step
    assert torch.equal(ranks[0]["weights"]["model.norm.weight"], ranks[1]["weights"]["model.norm.weight"])


def test_resume_in_the_middle_of_a_round_continues_the_same_rounds(run: Path):
    full, resumed = _facts(run, "full"), _facts(run, "resumed")
    for f, g in zip(full, resumed):
        assert g["global_step"] == 4  # no rank hung on a collective the other rank skipped
        # step 1 is half-way through round 0: every rank's buffer is in the checkpoint, so the resumed run finishes
        # round 0 from it without generating, then generates round 1 with round 1's seed
        assert g["calls"] == f["calls"][1:]
    full_t, resumed_t = _tensors(run, "full"), _tensors(run, "resumed")
    for f, g in zip(full_t, resumed_t):
        assert torch.equal(f["rounds"][1]["completion_ids"], g["rounds"][0]["completion_ids"])
        assert f["weights"].keys() == g["weights"].keys()
        for name in f["weights"]:
            assert torch.equal(f["weights"][name], g["weights"][name]), name
