"""2-process DDP on CPU (gloo): ExactResume with a plain shuffled DataLoader (see tests/scripts/ddp_plain_resume.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.ddp import output_tail, run_script

pytestmark = pytest.mark.ddp


def test_ddp_resumes_mid_window_mid_epoch_and_at_the_epoch_boundary_bit_exactly(tmp_path: Path) -> None:
    proc = run_script("ddp_plain_resume.py", tmp_path)
    assert proc.returncode == 0, output_tail(proc)
    mid_window = torch.load(tmp_path / "mid_window.ckpt", weights_only=True)
    assert mid_window["global_step"] == 1
    assert len(mid_window["callbacks"]["ExactResume"]["window_grads"]) == 2  # both ranks' half-window gradients
    for rank in (0, 1):
        full = torch.load(tmp_path / f"full_rank{rank}.pt", weights_only=True)
        assert full["step"] == 8 and len(full["targets"]) == 16
        for phase, trained in (("mid_window", 3), ("mid_epoch", 4), ("epoch_end", 8)):
            resumed = torch.load(tmp_path / f"{phase}_rank{rank}.pt", weights_only=True)
            assert resumed["targets"] == full["targets"][trained:], (phase, rank)
            for name, value in full["weights"].items():
                assert torch.equal(value, resumed["weights"][name]), (phase, rank, name)
