"""2-process DDP GRPO with an environment's tools: each rank runs its own environments on its own rows, the tool
metrics are over all ranks, and the synced gradient equals one process's on the whole round (see
``tests/scripts/ddp_grpo_tools.py``)."""

from __future__ import annotations

import ddp_grpo_tools as script  # tests/scripts: nothing runs on import
import pytest
import torch

from helpers.rounding import Rounding, relative_l2

pytestmark = pytest.mark.ddp


def test_each_rank_runs_its_own_environments_and_the_gradient_equals_one_process(ddp_world):
    out = ddp_world.part("grpo_tools")  # tests/scripts/ddp_grpo_tools.py
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    single = script.first_step(1)
    for record in ranks:
        assert record["env_pids"] and set(record["env_pids"]) == {record["pid"]}  # its own instances, its own process
        assert record["slices"][0]["completion_ids"].shape[0] == script.G  # its prompt's rollouts only
        for name in ("tools/call_frequency", "tools/failure_frequency", "reward", "rewards/PidEnv/mean"):
            assert float(record["metrics"][name]) == pytest.approx(float(single["metrics"][name])), name
    assert ranks[0]["pid"] != ranks[1]["pid"]
    # the synced DDP gradient against one process on all six rollouts: the same rows and advantages, summed in another
    # order, so they differ by float32 rounding; this batch's gradient is badly conditioned (a group's advantages sum
    # to zero), so the tolerance is calibrated on the one-process run in float32 against float64
    grads = ranks[0]["grads"]
    assert relative_l2(grads, ranks[1]["grads"]) == 0.0
    rounding = Rounding.of(single["grads"], script.first_step(1, torch.float64)["grads"], what="gradient")
    observed = relative_l2(grads, single["grads"])
    assert observed <= rounding.bound, f"DDP gradient differs by {observed:.2e} > {rounding.bound:.2e}"
    assert rounding.bound < 1e-2  # far below a wrong normaliser or advantage (order-1 relative changes)


def test_sharded_ranks_with_different_turn_counts_stay_in_step_and_equal_one_process(ddp_world):
    """Under FSDP2 every ``generate`` is a collective: rank 0's rollouts call the tool (two turns), rank 1's answer
    directly (one turn), so rank 1 must run a throwaway generation while rank 0 continues, or the run hangs (the
    script's timeout) or mixes the ranks' forwards. The policy is the real model with forced replies."""
    import fsdp_grpo_tools as sharded

    out = ddp_world.part("fsdp_grpo_tools")  # a hang shows as the world's (or the lone run's) time-out
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["sharded"] for r in ranks)
    assert ranks[0]["generate_calls"] == [sharded.G, sharded.G]  # its rollouts' first turns, then their second turns
    assert ranks[1]["generate_calls"] == [sharded.G, 1]  # one turn each, then the throwaway row
    single = sharded.first_step(1)
    assert single["generate_calls"] == [2 * sharded.G, sharded.G]
    # the ranks together buffered the rollouts one process buffered (rows in another order: the buffer shuffles)
    assert sorted(_rows(ranks[0]) + _rows(ranks[1])) == sorted(_rows(single))
    for record in ranks:
        for name in ("tools/call_frequency", "tools/failure_frequency", "reward", "reward_std"):
            assert record["metrics"][name] == pytest.approx(single["metrics"][name]), name
    grads = ranks[0]["grads"]
    assert relative_l2(grads, ranks[1]["grads"]) == 0.0  # the full gradient, gathered on both ranks
    rounding = Rounding.of(single["grads"], sharded.first_step(1, torch.float64)["grads"], what="gradient")
    observed = relative_l2(grads, single["grads"])
    assert observed <= rounding.bound, f"sharded gradient differs by {observed:.2e} > {rounding.bound:.2e}"
    assert rounding.bound < 1e-2  # far below a wrong normaliser, advantage or tool mask (order-1 relative changes)


def _rows(record: dict) -> list[tuple]:
    """Each buffered rollout as (completion ids, loss mask, attention mask, advantage), padding dropped."""
    rows = []
    for part in record["slices"]:
        for ids, loss, attention, advantage in zip(
            part["completion_ids"], part["completion_mask"], part["completion_attention_mask"], part["advantages"]
        ):
            n = int(attention.sum())
            rows.append(
                (
                    tuple(ids[:n].tolist()),
                    tuple(loss[:n].tolist()),
                    tuple(attention[:n].tolist()),
                    round(float(advantage), 5),
                )
            )
    return rows
