"""Ctrl-C during ``lit-trainer fit`` (the shipped recipes handle SIGINT with JITCheckpoint): the first one saves at the
next optimizer step and exits with 130, printing how to continue; the continued run ends bit-exact with an
uninterrupted one; a second Ctrl-C stops at once without a checkpoint."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest
import torch

from helpers.cli import QUIET_FIT
from helpers.ddp import output_tail, run_lit_trainer, script_env
from helpers.signals import SignalAt
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.cli.app import main

SFT = str(Path(__file__).resolve().parents[1] / "configs" / "sft.yaml")
QUIET = QUIET_FIT


@pytest.fixture(autouse=True)
def _restore_sigint():
    """Lightning leaves SIGINT ignored after it handled a KeyboardInterrupt; give the next test Python's default."""
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)


def _fit(steps: int, *args: str, **kwargs) -> LitTrainerCLI:
    return LitTrainerCLI(args=["fit", "--config", SFT, "--trainer.max_steps", str(steps), *QUIET, *args], **kwargs)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def test_first_ctrl_c_saves_at_the_next_step_exits_130_and_the_resume_is_bit_exact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JITCheckpointExit) as stopped:
        _fit(6, trainer_defaults={"callbacks": [SignalAt(2, "SIGINT")]})
    assert stopped.value.code == 130
    saved = Path(stopped.value.checkpoint_path)
    # no kill_wait for a Ctrl-C: the recipe's 3 s would have let several more steps run first
    assert saved.name == "last-jit-epoch=0-step=2.ckpt" and saved.parent.name == "checkpoints"
    resumed = _fit(6, "--ckpt_path", "last")
    assert Path(resumed.trainer.ckpt_path).resolve() == saved.resolve()
    uninterrupted = _fit(6, "--run_name", "reference")
    ours, reference = _weights(Path(resumed.trainer.log_dir)), _weights(Path(uninterrupted.trainer.log_dir))
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)


def test_a_stop_prints_one_instruction_and_it_continues_the_run(tmp_path, monkeypatch, capfd, caplog):
    # the callback used to say `fit(..., ckpt_path=...)` and the CLI `--ckpt_path last`: one instruction now, the CLI's
    # (SIGINT: the same save and message as SIGTERM, without the recipe's 3 s kill_wait, which outlasts this short run)
    monkeypatch.chdir(tmp_path)
    signal_at = ["--trainer.callbacks+=helpers.signals.SignalAt", "--trainer.callbacks.step=2"]
    signal_at += ["--trainer.callbacks.signal_name=SIGINT"]
    with pytest.raises(JITCheckpointExit) as stopped:
        main(["fit", "--config", SFT, "--trainer.max_steps", "6", *QUIET, *signal_at])
    assert stopped.value.code == 130
    output = capfd.readouterr()
    lines = (output.out + output.err).splitlines() + [record.getMessage() for record in caplog.records]
    told = [line for line in lines if "continue" in line.lower() or "ckpt_path" in line]
    assert len(told) == 1, told
    assert "fit(..., ckpt_path" not in told[0]
    saved = stopped.value.checkpoint_path
    assert told[0].startswith(f"JITCheckpoint: saved step 2 to {saved} in ")
    command = shlex.split(told[0].split("To continue this run: ", 1)[1])
    assert command[:2] == ["lit-trainer", "fit"] and command[-2:] == ["--ckpt_path", "last"]
    resumed = LitTrainerCLI(args=command[1:])  # the printed command, as a person would paste it
    assert Path(resumed.trainer.ckpt_path).resolve() == Path(saved).resolve()
    assert resumed.trainer.global_step == 6


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:  # Lightning's KeyboardInterrupt handling ends with exit status 1
        _fit(6, trainer_defaults={"callbacks": [SignalAt(2, "SIGINT", times=2)]})
    assert stopped.value.code == 1 and not isinstance(stopped.value, JITCheckpointExit)
    assert not list(tmp_path.rglob("last-jit-*.ckpt"))


@pytest.mark.slow
def test_ctrl_c_in_the_console_script_prints_the_command_that_continues_the_run(tmp_path):
    signal_at = ["--trainer.callbacks+=helpers.signals.SignalAt", "--trainer.callbacks.step=2"]
    signal_at += ["--trainer.callbacks.signal_name=SIGINT"]
    env = {"PYTHONPATH": script_env()["PYTHONPATH"]}
    fit = ["fit", "--config", SFT, "--trainer.max_steps", "5", *QUIET]
    stopped = run_lit_trainer(*fit, *signal_at, cwd=tmp_path, **env)
    assert stopped.returncode == 130, output_tail(stopped)
    assert "SIGINT received" in stopped.stderr and "Press Ctrl-C again" in stopped.stderr, output_tail(stopped)
    (hint,) = [line for line in stopped.stderr.splitlines() if "To continue this run: " in line]
    command = shlex.split(hint.split("To continue this run: ", 1)[1])
    assert command[:2] == ["lit-trainer", "fit"] and command[-2:] == ["--ckpt_path", "last"]
    resumed = run_lit_trainer(*command[1:], cwd=tmp_path, **env)  # the printed command, as a person would paste it
    assert resumed.returncode == 0, output_tail(resumed)
    assert "resuming from runs/sft/version_0/checkpoints/last-jit-epoch=0-step=2.ckpt" in resumed.stderr
    (tmp_path / "ref").mkdir()
    uninterrupted = run_lit_trainer(*fit, cwd=tmp_path / "ref")
    assert uninterrupted.returncode == 0, output_tail(uninterrupted)
    ours, reference = _weights(tmp_path / "runs/sft/version_0"), _weights(tmp_path / "ref/runs/sft/version_0")
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
