"""A SIGTERM that reaches one rank of a 2-rank DDP GRPO run in the middle of a generation round (issue 31, item 2).

The ranks are started as torchrun or Slurm start them (one ``lit-trainer`` process per rank, CPU, gloo), so the test
holds both pids and both exit statuses. From step 2 on, every round asks for 100,000 tokens per row with EOS
suppressed (``helpers.signals.EndlessRoundAt``: hours on CPU); once both ranks generate, rank 1 alone gets SIGTERM.
Rank 0 never gets the signal, yet both ranks must end their generation, agree, save step 2 (the round is dropped)
and exit 143; the resumed run must end with the weights of an uninterrupted one. The subprocess timeouts are hang
guards (no timing is asserted): without the stop reaching rank 0, its generation would outlast them by hours.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from test_signal_stops import SMALL_GRPO, VARIED, _config, _weights

from helpers.cli import QUIET_FIT
from helpers.ddp import launch_lit_trainer_ranks, wait_json
from helpers.signals import EndlessRoundAt

pytestmark = [pytest.mark.slow, pytest.mark.ddp]

TWO_RANKS = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp"]


def _finish(procs: list[subprocess.Popen], cwd: Path, timeout: float = 300) -> list[int]:
    """Every rank's exit status; kills the ranks left and fails with their logs after ``timeout`` (a hang guard)."""
    try:
        return [proc.wait(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank hung:\n" + _logs(cwd))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _logs(cwd: Path) -> str:
    return "\n".join(f"--- rank {r}\n" + (cwd / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))


def _run(cwd: Path, *args: str) -> None:
    codes = _finish(launch_lit_trainer_ranks(*args, cwd=cwd), cwd)
    assert codes == [0, 0], _logs(cwd)


def test_sigterm_to_rank_1_alone_during_an_endless_round_stops_both_ranks_and_the_resume_is_exact(tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # 40 addition prompts: the built-in set's 8,100 take seconds per rank
    prompts.write_text("".join(f'{{"prompt": "{a}+{a + 7}="}}\n' for a in range(10, 50)))
    fit = ["fit", "--config", _config(tmp_path, "grpo.yaml"), *QUIET_FIT, *TWO_RANKS, *SMALL_GRPO, *VARIED]
    fit += ["--trainer.max_steps=3", f"--data.init_args.dataset={prompts}"]
    fit += ["--data.init_args.batch_size=8"]  # a round: 2 micro-batches of 8 rows (1 prompt x 8) per rank
    endless = ["--trainer.callbacks+=helpers.signals.EndlessRoundAt", f"--trainer.callbacks.out={tmp_path}"]
    procs = launch_lit_trainer_ranks(*fit, *endless, "--trainer.callbacks.step=2", cwd=tmp_path)
    try:
        for rank in (0, 1):  # both ranks are inside step 2's generation call
            wait_json(tmp_path / f"generating_rank{rank}.json", procs[rank], tmp_path / f"rank{rank}.log", 300)
        os.kill(procs[1].pid, signal.SIGTERM)
    finally:
        codes = _finish(procs, tmp_path)
    assert codes == [143, 143], _logs(tmp_path)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    assert "SIGTERM received on rank 1" in logs[1] and "SIGTERM received" not in logs[0]
    for rank in (0, 1):
        assert wait_json(tmp_path / f"stop_rank{rank}.json", procs[rank], tmp_path / "unused.log", 1) == {
            "exception": "JITCheckpointExit",
            "code": 143,
            "step": 2,
        }
        generated = wait_json(tmp_path / f"generated_rank{rank}.json", procs[rank], tmp_path / "unused.log", 1)
        assert generated["tokens"] < EndlessRoundAt.TOKENS  # both generations were cut short, rank 0's too
    run = tmp_path / "runs/grpo/version_0"
    assert sorted(os.listdir(run / "checkpoints")) == ["last-jit-epoch=0-step=2.ckpt"]
    saved = torch.load(run / "checkpoints/last-jit-epoch=0-step=2.ckpt", weights_only=False)
    assert saved["global_step"] == 2
    assert [r["rounds"] for r in saved["grpo_rollouts"]["ranks"]] == [2, 2]  # step 2's round was dropped on both

    _run(tmp_path, *fit, "--ckpt_path", "last")  # the requeued job: the round of step 2 is generated again
    _run(tmp_path, *fit, "--run_name", "reference")
    ours, theirs = _weights(run), _weights(tmp_path / "runs/reference/version_0")
    assert any(not torch.equal(saved["state_dict"][k], theirs[k]) for k in theirs)  # step 2 moved the weights
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
