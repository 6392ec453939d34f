"""GRPO (through its rollout worker) and RLOO (in the training process, FSDP2 with LoRA) sampled by vLLM on 2 ranks,
DDP and FSDP2 (tests/scripts/ddp_vllm.py): every rank's vLLM has every step's weights (the sampler check's bound is
tests/test_vllm_engine.py's: float32 rounding), and the ranks train one model.

Ten vLLM servers start in this test (one per rank and case; the fifth case is on-policy distillation with a sharded
student), about 11 s each on 2 CPU cores, two at a time."""

from __future__ import annotations

import pytest
import torch

from helpers.ddp import output_tail, run_script
from helpers.vllm_env import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.ddp]

ROUNDING = 1e-4  # tests/test_vllm_engine.py


def test_vllm_under_ddp_and_fsdp2_gets_every_steps_weights_on_every_rank(tmp_path, monkeypatch):
    """RLOO's check scores every round from its first (no worker, no stale round), GRPO's from the second callback
    read (the first step logs before the callback reads)."""
    monkeypatch.setenv("LIT_TRAINER_VLLM_PYTHON", vllm_python())
    proc = run_script("ddp_vllm.py", tmp_path, timeout=1200)
    assert proc.returncode == 0, output_tail(proc)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for name in ("ddp", "sharded", "rloo_ddp", "rloo_sharded_lora"):
        for rank in ranks:
            gaps = rank[name]["gaps"]
            assert len(gaps) >= 2 and max(gaps) < ROUNDING, (name, gaps)
        first, second = ranks[0][name], ranks[1][name]
        moved = [n for n in first["final"] if not torch.equal(first["final"][n], first["initial"][n])]
        assert moved, f"{name}: nothing trained"
        for n in first["final"]:  # one model: every rank ends with the same weights
            assert torch.equal(first["final"][n], second["final"][n]), (name, n)
    # distillation, the student sharded: each rank's vLLM reloaded after steps 1 and 2 (before the samples of 2 and 3)
    first, second = (rank["distill_sharded"] for rank in ranks)
    assert first["reloads"] == second["reloads"] == 2
    assert any(not torch.equal(first["final"][n], first["initial"][n]) for n in first["final"])
    assert all(torch.equal(first["final"][n], second["final"][n]) for n in first["final"])
