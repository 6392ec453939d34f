"""2-process DDP on CPU (gloo): ExactResume with a plain shuffled DataLoader (see tests/scripts/ddp_plain_resume.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.ddp


def test_ddp_resumes_mid_window_mid_epoch_and_at_the_epoch_boundary_bit_exactly(ddp_world) -> None:
    out = ddp_world.part("plain_resume")  # tests/scripts/ddp_plain_resume.py
    mid_window = torch.load(out / "mid_window.ckpt", weights_only=True)
    assert mid_window["global_step"] == 1
    assert len(mid_window["callbacks"]["ExactResume"]["window_grads"]) == 2  # both ranks' half-window gradients
    for rank in (0, 1):
        full = torch.load(out / f"full_rank{rank}.pt", weights_only=True)
        assert full["step"] == 8 and len(full["targets"]) == 16
        for phase, trained in (("mid_window", 3), ("mid_epoch", 4), ("epoch_end", 8)):
            resumed = torch.load(out / f"{phase}_rank{rank}.pt", weights_only=True)
            assert resumed["targets"] == full["targets"][trained:], (phase, rank)
            for name, value in full["weights"].items():
                assert torch.equal(value, resumed["weights"][name]), (phase, rank, name)
