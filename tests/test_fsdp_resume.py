"""``configs/sft_fsdp.yaml`` through the ``lit-trainer`` command on 2 CPU ranks (ModelParallelStrategy, gloo):
SIGTERM to one rank -> both ranks save one complete (distributed, directory) checkpoint and the job exits 143; the
SAME command line run again resumes from it (the config's ``ckpt_path: last``) and ends bit-exact with an
uninterrupted sharded run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.ddp import script_env

pytestmark = pytest.mark.ddp


ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sft_fsdp.yaml"
STEPS = 6


def _command(out: Path) -> list[str]:
    data = out / "rows.jsonl"  # small data: the test is about the checkpoint, not the task
    data.write_text("".join(f'{{"text": "{i} plus {i} is {2 * i}"}}\n' for i in range(48)))
    return [
        shutil.which("lit-trainer") or "lit-trainer",
        "fit",
        "--config",
        str(CONFIG),
        f"--data.dataset={data}",
        "--data.val_size=0",
        "--model.eval_exact_match=false",
        f"--trainer.max_steps={STEPS}",
        "--trainer.accumulate_grad_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--model.warmup_steps=2",
        "--model.model=tiny-64",
        "--data.batch_size=4",
        "--data.eval_batch_size=4",
        "--trainer.callbacks+=fsdp_sigterm_probe.SigtermOneRank",
        f"--trainer.callbacks.out={out}",
    ]


def _run(cwd: Path, command: list[str], sigterm_at: int | None) -> subprocess.CompletedProcess:
    env = script_env()  # tests/scripts on PYTHONPATH: the command line names fsdp_sigterm_probe.SigtermOneRank
    env.pop("FSDP_TEST_SIGTERM_STEP", None)
    if sigterm_at is not None:
        env["FSDP_TEST_SIGTERM_STEP"] = str(sigterm_at)
    return subprocess.run(command, check=False, cwd=cwd, env=env, timeout=600, capture_output=True, text=True)


def test_sigterm_to_one_rank_saves_once_and_the_same_command_resumes_bit_exact(tmp_path: Path):
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    interrupted.mkdir()
    reference.mkdir()
    command = _command(interrupted)
    first = _run(interrupted, command, sigterm_at=3)
    assert first.returncode == 143, first.stderr[-3000:]
    jit_dir = interrupted / "runs" / "sft_fsdp" / "jit"
    saved = sorted(p.name for p in jit_dir.iterdir())
    assert saved == ["jit-epoch=0-step=3.ckpt"], saved  # one checkpoint, no partial left, no sentinel
    assert (jit_dir / saved[0]).is_dir() and (jit_dir / saved[0] / "meta.pt").is_file()  # sharded: a directory
    assert not list(interrupted.glob("final_*"))  # no rank finished

    second = _run(interrupted, command, sigterm_at=3)  # the requeued job: the very same command line
    assert second.returncode == 0, second.stderr[-3000:]
    assert "jit-epoch=0-step=3.ckpt" in second.stdout + second.stderr  # resumed from the JIT checkpoint
    uninterrupted = _run(reference, _command(reference), sigterm_at=None)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    for rank in (0, 1):
        resumed = torch.load(interrupted / f"final_resumed_rank{rank}.pt")
        fresh = torch.load(reference / f"final_fresh_rank{rank}.pt")
        assert resumed["step"] == fresh["step"] == STEPS
        assert all(torch.equal(resumed["weights"][k], fresh["weights"][k]) for k in fresh["weights"])
