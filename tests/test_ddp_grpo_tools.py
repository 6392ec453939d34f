"""2-process DDP GRPO with an environment's tools: each rank runs its own environments on its own rows, the tool
metrics are over all ranks, and the synced gradient equals one process's on the whole round (see
``tests/scripts/ddp_grpo_tools.py``)."""

from __future__ import annotations

from pathlib import Path

import ddp_grpo_tools as script  # tests/scripts: nothing runs on import
import pytest
import torch

from helpers.ddp import output_tail, run_script
from helpers.rounding import Rounding, relative_l2

pytestmark = pytest.mark.ddp


def test_each_rank_runs_its_own_environments_and_the_gradient_equals_one_process(tmp_path: Path):
    proc = run_script("ddp_grpo_tools.py", tmp_path)
    assert proc.returncode == 0, output_tail(proc)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
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
