"""GRPO and RLOO resume bit for bit on 2 CPU ranks (tests/scripts/ddp_grpo_async_resume.py): asynchronous GRPO at
``max_staleness=1`` under DDP and FSDP2, and synchronous GRPO (with its adaptive entropy bonus) and RLOO from a
checkpoint inside a round under FSDP2.

FSDP2 (``ModelParallelStrategy``) loads a checkpoint after ``on_fit_start``, where the other strategies load it before:
the round buffer, the generation seed, the entropy control and the asynchronous weights versions were restored in
``on_fit_start`` only, so under FSDP2 a resume silently started the rounds afresh (the sharded cases failed on that
code; the DDP case passed). The final full weights are compared with ``torch.equal``: CPU, the same reductions in the
same order.
"""

from __future__ import annotations

import pytest
import torch

from helpers.ddp import output_tail, run_script

pytestmark = [pytest.mark.slow, pytest.mark.ddp]

CASES = ("ddp", "sharded", "sharded_sync_mid_round", "rloo_sharded_mid_round")


def test_resume_on_two_ranks_is_the_uninterrupted_run_under_ddp_and_fsdp2(tmp_path):
    proc = run_script("ddp_grpo_async_resume.py", tmp_path, timeout=900)
    assert proc.returncode == 0, output_tail(proc)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in ranks:
        assert set(rank) == set(CASES)
        for name, case in rank.items():
            whole, resumed, at_stop = case["whole"], case["resumed"], case["at_stop"]
            assert any(not torch.equal(whole[n], at_stop[n]) for n in whole), f"{name}: no step after the stop"
            for n in whole:
                assert torch.equal(whole[n], resumed[n]), (name, n)
            # asynchronous: the rounds after the resume are as stale as the uninterrupted run's (not fresher)
            after = {s: v for s, v in case["whole_staleness"].items() if s in case["resumed_staleness"]}
            assert case["resumed_staleness"] == after, name
            if name in ("ddp", "sharded"):
                assert 1.0 in case["resumed_staleness"].values(), name
    for name in CASES:  # one model: both ranks end with the same weights
        assert all(torch.equal(ranks[0][name]["whole"][n], ranks[1][name]["whole"][n]) for n in ranks[0][name]["whole"])
