"""JITCheckpoint: argument checks, kill_wait, in-process signals, a failing save, and a real 2-process DDP run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO

from helpers.ddp import launch_script, wait_json
from lit_trainer.callbacks import jit_checkpoint
from lit_trainer.callbacks.jit_checkpoint import JITCheckpoint, JITCheckpointExit
from lit_trainer.checkpoint_io import SENTINEL_NAME, sentinel_target
from lit_trainer.core.stop_request import stop_in_step
from lit_trainer.data.loader import TrainLoader
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kill_wait": -1}, r"kill_wait=-1.*>= 0"),
        ({"kill_wait": float("nan")}, r"kill_wait=nan"),
        ({"signals": ["SIGKILL"]}, r"\['SIGKILL'\] cannot be handled.*SIGKILL and SIGSTOP cannot be caught"),
        ({"signals": ["SIGTERMX"]}, r"\['SIGTERMX'\] cannot be handled"),
        ({"signals": "SIGTERM"}, r"pass a non-empty list such as \['SIGTERM'\]"),
        ({"exit_code": 256}, r"exit_code=256.*0-255 or None"),
        ({"dirpath": "s3://bucket/run"}, r"dirpath='s3://bucket/run'.*local"),
        ({"filename": "jit-{rank}"}, r"only the placeholders \{epoch\} and \{step\}"),
    ],
)
def test_invalid_arguments_name_the_value_and_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JITCheckpoint(**kwargs)


class _Clock:
    """Stands in for the ``time`` module of ``jit_checkpoint``: ``monotonic()`` is ``now``, which only the test moves
    (so no assertion depends on how fast this machine runs)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return time.perf_counter()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(jit_checkpoint, "time", fake)
    return fake


def test_kill_wait_delays_the_request(clock: _Clock) -> None:
    jit = JITCheckpoint(kill_wait=0.5)
    assert not jit.requested and not jit._due()
    jit._handle(signal.SIGTERM, None)
    assert jit.requested and not jit._due()  # recorded at once, acted on only after kill_wait
    clock.now += 0.25
    jit._handle(signal.SIGTERM, None)  # a second signal does not restart the wait
    assert not jit._due()
    clock.now += 0.25
    assert jit._due()


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.layer(batch["x"]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SignalSelf(Callback):
    """Sends SIGTERM to this process at the start of micro-batch ``at`` and records the installed handler."""

    def __init__(self, at: int) -> None:
        self.at, self.handler_in_training = at, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            self.handler_in_training = signal.getsignal(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)


def _loader() -> TrainLoader:
    rows = [{"x": torch.full((4,), float(i))} for i in range(8)]
    return TrainLoader(
        rows,
        ShardedBatchSampler(8, 1, seed=0),
        lambda b: {"x": torch.stack([r["x"] for r in b])},
        accumulate_grad_batches=2,
    )


def _trainer(tmp_path: Path, callbacks: list, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


@pytest.fixture
def own_sigterm_handler() -> Any:
    def original(signum: int, frame: Any) -> None:
        raise AssertionError("the pre-fit SIGTERM handler must not run while JITCheckpoint is installed")

    previous = signal.signal(signal.SIGTERM, original)
    yield original
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("exit_code", [None, 143])
def test_signal_mid_window_saves_after_that_step_and_stops(
    tmp_path: Path, own_sigterm_handler: Any, exit_code: int | None
) -> None:
    # 8 micro-batches, 2 per optimizer step: the signal lands before micro-batch 2, the first of step 2's window,
    # so the save must come after micro-batches 2 and 3, at global_step 2 (never after micro-batch 2 alone)
    jit, other, sender = (
        JITCheckpoint(kill_wait=0, dirpath=tmp_path / "ckpt", exit_code=exit_code),
        Callback(),
        _SignalSelf(2),
    )
    trainer = _trainer(tmp_path, [jit, other, sender])
    module = _Net()
    if exit_code is None:
        trainer.fit(module, _loader())
    else:
        with pytest.raises(JITCheckpointExit) as stopped:
            trainer.fit(module, _loader())
        assert stopped.value.code == 143 and isinstance(stopped.value, SystemExit)
        assert stopped.value.checkpoint_path == jit.checkpoint_path
    final = tmp_path / "ckpt" / "last-jit-epoch=0-step=2.ckpt"
    assert trainer.global_step == 2 and jit.checkpoint_path == str(final)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [final.name]  # no sentinel, no partial file left
    ckpt = torch.load(final, weights_only=True)
    assert ckpt["global_step"] == 2
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 4}]
    # the checkpoint holds exactly the applied updates: no optimizer step ran after the save
    assert all(torch.equal(ckpt["state_dict"][k], v) for k, v in module.state_dict().items())
    # our handler replaced Lightning's during training (so Lightning never saw the signal), then the original is back
    assert getattr(sender.handler_in_training, "__func__", None) is JITCheckpoint._handle
    assert trainer.received_sigterm is False
    assert signal.getsignal(signal.SIGTERM) is own_sigterm_handler
    assert trainer.callbacks.index(jit) > trainer.callbacks.index(other)


class _StopsInStep(_Net):
    """Asks the stop requester at the first micro-batch of every window, before any backward (as GRPO's round does)."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx % 2 == 0:
            stop_in_step(self.trainer)
        return super().training_step(batch, batch_idx)


def test_a_save_inside_a_batch_saves_the_loader_position_lightning_resumes_at(
    tmp_path: Path, own_sigterm_handler: Any
) -> None:
    # the signal lands before micro-batch 2 and the save is inside it (step 1 is the last finished one): Lightning
    # resumes that checkpoint at micro-batch 2, so the loader's position must not count it (it used to be 3)
    jit = JITCheckpoint(kill_wait=0, dirpath=tmp_path / "ckpt")
    with pytest.raises(JITCheckpointExit):
        _trainer(tmp_path, [jit, _SignalSelf(2)]).fit(_StopsInStep(), _loader())
    ckpt = torch.load(tmp_path / "ckpt" / "last-jit-epoch=0-step=1.ckpt", weights_only=True)
    fit_loop = ckpt["loops"]["fit_loop"]
    assert fit_loop["epoch_loop.batch_progress"]["current"]["completed"] == 2
    assert fit_loop["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 2}]


class _AdvanceClock(Callback):
    """Moves the fake clock forward by ``seconds`` at the start of micro-batch ``at``."""

    def __init__(self, clock: _Clock, at: int, seconds: float) -> None:
        self.clock, self.at, self.seconds = clock, at, seconds

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            self.clock.now += self.seconds


def test_the_save_waits_for_the_first_step_boundary_after_kill_wait(
    tmp_path: Path, own_sigterm_handler: Any, clock: _Clock
) -> None:
    # the signal lands before micro-batch 0; kill_wait passes during micro-batch 4 (the first of step 3's window):
    # steps 1 and 2 train on, the save is after step 3
    jit = JITCheckpoint(kill_wait=5.0, dirpath=tmp_path / "ckpt", exit_code=None)
    trainer = _trainer(tmp_path, [jit, _SignalSelf(0), _AdvanceClock(clock, at=4, seconds=5.0)])
    trainer.fit(_Net(), _loader())
    assert trainer.global_step == 3 and jit.checkpoint_path == str(tmp_path / "ckpt" / "last-jit-epoch=0-step=3.ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["last-jit-epoch=0-step=3.ckpt"]


class _FullDisk(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        raise OSError("No space left on device")


def test_failed_save_keeps_the_sentinel_and_raises(tmp_path: Path, own_sigterm_handler: Any) -> None:
    jit = JITCheckpoint(kill_wait=0, dirpath=tmp_path / "ckpt")
    trainer = _trainer(tmp_path, [jit, _SignalSelf(0)], plugins=[_FullDisk()])
    with pytest.raises(OSError, match="No space left"):
        trainer.fit(_Net(), _loader())
    assert sentinel_target(tmp_path / "ckpt") == "last-jit-epoch=0-step=1.ckpt"
    assert sorted(os.listdir(tmp_path / "ckpt")) == [SENTINEL_NAME]
    assert signal.getsignal(signal.SIGTERM) is own_sigterm_handler


# ---------------------------------------------------------------------------------------------------------------
# Real DDP: 2 processes on CPU/gloo (tests/scripts/ddp_sigterm.py)
# ---------------------------------------------------------------------------------------------------------------


def _log(out: Path) -> str:
    return (out / "ddp.log").read_text()[-4000:]


def _wait_json(path: Path, proc: subprocess.Popen) -> dict:
    return wait_json(path, proc, path.parent / "ddp.log")


def _wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text():
        assert time.monotonic() < deadline, f"rank process {pid} did not exit"
        time.sleep(0.05)


def _launch(out: Path) -> subprocess.Popen:
    return launch_script("ddp_sigterm.py", out, log=out / "ddp.log")


def _stops(out: Path, fit: str) -> list[dict]:
    return [json.loads((out / f"{fit}_stop_rank{r}.json").read_text()) for r in (0, 1)]


def _one_checkpoint(folder: Path, step: int) -> None:
    assert sorted(os.listdir(folder)) == [f"last-jit-epoch={(step - 1) // 4}-step={step}.ckpt"]  # 4 steps per epoch
    ckpt = torch.load(folder / os.listdir(folder)[0], weights_only=True)
    assert ckpt["global_step"] == step
    rng = ckpt["callbacks"]["ExactResume"]
    assert rng["world_size"] == 2 and not torch.equal(rng["ranks"][0]["torch"], rng["ranks"][1]["torch"])


@pytest.mark.ddp
def test_ddp_sigterm_to_one_rank_then_to_both_stops_together_and_resumes_exactly(tmp_path: Path) -> None:
    proc = _launch(tmp_path)
    try:
        # phase 1: an uninterrupted reference fit, then a fit whose rank 1 alone gets SIGTERM before micro-batch 4
        # (the first of step 3's window): both ranks must save step 3 together and exit with status 143
        paused = _wait_json(tmp_path / "b_paused_rank1.json", proc)
        os.kill(paused["pid"], signal.SIGTERM)
        phase1 = _wait_json(tmp_path / "phase1_status.json", proc)
        _wait_gone(paused["pid"])
        # phase 2: resume; SIGTERM to both ranks before micro-batch 2 of epoch 1 -> both save step 6
        # (exit_code=None: fit returns); then resume that checkpoint to the end
        pids = [_wait_json(tmp_path / f"c_paused_rank{r}.json", proc)["pid"] for r in (0, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        phase2 = _wait_json(tmp_path / "phase2_status.json", proc)
        assert proc.wait(timeout=300) == 0, _log(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    # 143, or -9 when Lightning's child-process watchdog in rank 0 saw rank 1 exit non-zero first (after the save)
    assert phase1["returncode"] in (143, -signal.SIGKILL), _log(tmp_path)
    assert [(s["exception"], s["code"], s["step"]) for s in _stops(tmp_path, "b")] == [
        ("JITCheckpointExit", 143, 3)
    ] * 2
    _one_checkpoint(tmp_path / "ckpt_b", 3)
    assert phase2["returncode"] == 0, _log(tmp_path)
    assert [(s["exception"], s["step"], s["should_stop"]) for s in _stops(tmp_path, "c")] == [(None, 6, True)] * 2
    _one_checkpoint(tmp_path / "ckpt_c", 6)
    # the resumed chain ends with the weights of the uninterrupted run, bit for bit, on each rank
    for rank in (0, 1):
        expected = torch.load(tmp_path / f"ref_final_rank{rank}.pt", weights_only=True)
        got = torch.load(tmp_path / f"d_final_rank{rank}.pt", weights_only=True)
        assert all(torch.equal(expected[k], got[k]) for k in expected), f"rank {rank} differs"


def test_a_signal_too_late_to_act_on_is_forgotten_when_training_ends():
    """A SIGTERM after the last optimizer step (during the final validation or export) is never acted on; it must not
    linger as a stop request that would cut a later `trainer.validate`'s generations short in the same process."""
    import signal as signals

    callback = JITCheckpoint(kill_wait=0)
    callback._handle(signals.SIGTERM, None)
    assert callback.stop_requested
    callback.on_train_end(None, None)
    assert not callback.stop_requested
