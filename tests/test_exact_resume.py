"""ExactResume and the choice of a complete checkpoint; fault injection with real signals (tests/scripts)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from helpers.ddp import launch_script, wait_json
from lit_trainer.callbacks import ExactResume, resolve_resume, resolve_resume_checkpoint
from lit_trainer.callbacks.resume._rng_state import apply_rng_state, collect_rng_state
from lit_trainer.checkpoint_io import SENTINEL_NAME, sentinel_target, write_sentinel


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randn(2).tolist()


def test_rng_state_round_trip_is_exact_and_loads_weights_only(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # numpy now holds a cached gaussian, which must be restored too
    state = collect_rng_state(torch.device("cpu"))
    expected = _draws()
    apply_rng_state(state)
    assert _draws() == expected
    # a state_dict from ExactResume goes through torch.save / torch.load(weights_only=True) unchanged
    callback_state = ExactResume().state_dict()
    assert callback_state["world_size"] == 1 and len(callback_state["ranks"]) == 1
    torch.save({"callbacks": {"ExactResume": callback_state}}, tmp_path / "c.ckpt")
    loaded = torch.load(tmp_path / "c.ckpt", weights_only=True)["callbacks"]["ExactResume"]
    after_save = _draws()
    apply_rng_state(loaded["ranks"][0])
    assert _draws() == after_save != expected


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Batches:
    """An iterable of batches that is neither a DataLoader (replayed by ExactResume) nor stateful."""

    def __iter__(self):
        return iter([torch.ones(2, 2), torch.ones(2, 2)])

    def __len__(self) -> int:
        return 2


def test_loader_without_state_warns_and_resume_callback_goes_first(tmp_path: Path) -> None:
    callback = ExactResume()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Callback(), callback],
        default_root_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match=r"ExactResume: the training loader \(_Batches\) is neither .* not exact"):
        trainer.fit(_Linear(), _Batches())
    assert trainer.callbacks[0] is callback


def _ckpt(path: Path, mtime: float) -> Path:
    torch.save({"global_step": 1}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_resolve_picks_newest_complete_checkpoint_and_names_skipped_ones(tmp_path: Path) -> None:
    now = time.time()
    _ckpt(tmp_path / "old.ckpt", now - 50)
    good = _ckpt(tmp_path / "good.ckpt", now - 40)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(_ckpt(tmp_path / "x.tmp", now).read_bytes()[:100])  # first 100 bytes of a real archive
    os.utime(truncated, (now - 30, now - 30))
    pending = _ckpt(tmp_path / "pending.ckpt", now - 20)  # named by the sentinel: the save did not finish
    write_sentinel(tmp_path, "pending.ckpt", step=7)
    _ckpt(tmp_path / ".newest.ckpt.partial", now)  # a partial name is never a candidate
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    (sharded / SENTINEL_NAME).write_text("in progress")
    os.utime(sharded, (now - 10, now - 10))
    assert sentinel_target(tmp_path) == "pending.ckpt"
    with pytest.warns(UserWarning) as record:
        assert resolve_resume_checkpoint(tmp_path) == str(good)
    messages = " ".join(str(w.message) for w in record)
    for skipped in (truncated, pending, sharded):
        assert f"incomplete checkpoint {skipped}" in messages
    assert "partial" not in messages
    assert resolve_resume_checkpoint(tmp_path / "missing") is None
    # a list of folders: the newest complete one over all of them
    other = tmp_path / "other"
    other.mkdir()
    newer = _ckpt(other / "newer.ckpt", now - 5)
    with pytest.warns(UserWarning):
        assert resolve_resume_checkpoint([tmp_path, other]) == str(newer)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_resume_policy_never_silently_resumes(tmp_path: Path, package: str) -> None:
    ns = pytest.importorskip(package)  # a pytorch_lightning trainer turns None into "last" just the same
    run = tmp_path / "run"
    on_exception = ns.callbacks.OnExceptionCheckpoint(run / "checkpoints")
    trainer = ns.Trainer(accelerator="cpu", logger=False, default_root_dir=run, callbacks=[on_exception])
    # a fresh folder: "never" and "auto" both start fresh
    assert resolve_resume("never", run / "checkpoints", trainer) is None
    assert resolve_resume("auto", run / "checkpoints", trainer) is None
    # an old run's exception checkpoint: Lightning would turn ckpt_path=None into "last" and load it
    (run / "checkpoints").mkdir(parents=True)
    stale = _ckpt(run / "checkpoints" / "on_exception.ckpt", time.time())
    with pytest.raises(ValueError, match=r"resume='never'.*silently resume from .*on_exception\.ckpt"):
        resolve_resume("never", run / "checkpoints", trainer)
    with pytest.raises(ValueError, match="on_exception.ckpt"):
        resolve_resume(None, run / "checkpoints", trainer)
    assert resolve_resume("auto", run / "checkpoints", trainer) == str(stale)
    assert resolve_resume("last", run / "checkpoints", trainer) == str(stale)
    assert resolve_resume(str(stale), tmp_path / "elsewhere") == str(stale)
    # without an OnExceptionCheckpoint, ckpt_path=None is a fresh start in Lightning too: nothing to guard
    plain = ns.Trainer(accelerator="cpu", logger=False, default_root_dir=run)
    assert resolve_resume("never", run / "checkpoints", plain) is None
    with pytest.raises(ValueError, match="does not exist"):
        resolve_resume(str(run / "nope.ckpt"), run)
    write_sentinel(run / "checkpoints", "on_exception.ckpt", step=3)
    with pytest.raises(ValueError, match="save was interrupted"):
        resolve_resume(str(stale), run)


# ---------------------------------------------------------------------------------------------------------------
# Fault injection: a chain of forked runs of tests/scripts/fault_injection_train.py, real SIGTERM / SIGKILL
# ---------------------------------------------------------------------------------------------------------------


def _signal_at_pause(run: Path, proc: subprocess.Popen, log: Path, signum: int = signal.SIGTERM) -> tuple[dict, float]:
    ready = wait_json(run / "ready.json", proc, log)
    sent = time.time()
    os.kill(ready["pid"], signum)
    return ready, sent


@pytest.mark.ddp
def test_sigterm_at_several_points_then_resume_is_bit_exact(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    name = {s: f"last-jit-epoch=0-step={s}.ckpt" for s in (2, 3, 6)}
    plan = [
        {"name": "ref", "ckpt_dir": str(tmp_path / "ref_ckpt")},
        # validation after micro-batch 2 = mid-window (step 2 is batches 2+3): the save waits for step 2
        {"name": "val_mid_window", "ckpt_dir": str(ckpt), "pause": "val:0:2:1"},
        # the save of step 3 hangs half-written and is SIGKILLed
        {"name": "killed_in_save", "ckpt_dir": str(ckpt), "resume": "auto", "pause": "train:0:4", "slow_save": True},
        # validation after micro-batch 5 = right after step 3: saved when that validation ends
        {"name": "val_at_step", "ckpt_dir": str(ckpt), "resume": "auto", "pause": "val:0:5:0"},
        # between the two micro-batches of the epoch's last step: saved after step 6, the epoch boundary
        {"name": "epoch_end", "ckpt_dir": str(ckpt), "resume": "auto", "pause": "train:0:11"},
        {"name": "finish", "ckpt_dir": str(ckpt), "resume": "auto"},
    ]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    log = tmp_path / "runner.log"
    proc = launch_script("fault_injection_train.py", tmp_path, "--plan", tmp_path / "plan.json", log=log)
    latency: dict[str, float] = {}
    try:
        for run_name in ("val_mid_window", "killed_in_save", "val_at_step", "epoch_end"):
            run = tmp_path / run_name
            if run_name == "val_at_step":
                # the killed save left its sentinel and partial file; resolution skipped it (checked below)
                assert sentinel_target(ckpt) == name[3]
                assert (ckpt / f".{name[3]}.partial").exists() and not (ckpt / name[3]).exists()
                with pytest.warns(
                    UserWarning, match=rf"incomplete checkpoint {ckpt / name[3]}: its save was interrupted"
                ):
                    assert resolve_resume_checkpoint(ckpt) == str(ckpt / name[2])
            _, sent = _signal_at_pause(run, proc, log)
            if run_name == "killed_in_save":
                saving = wait_json(run / "saving.json", proc, log)
                os.kill(saving["pid"], signal.SIGKILL)
            status = wait_json(run / "status.json", proc, log)
            latency[run_name] = status["end"] - sent
        wait_json(tmp_path / "finish" / "status.json", proc, log)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    status = {r: json.loads((tmp_path / r / "status.json").read_text())["returncode"] for r in latency}
    assert status == {"val_mid_window": 143, "killed_in_save": -signal.SIGKILL, "val_at_step": 143, "epoch_end": 143}
    result = {
        r["name"]: json.loads((tmp_path / r["name"] / "result.json").read_text())
        for r in plan
        if r["name"] != "killed_in_save"
    }
    assert not (tmp_path / "killed_in_save" / "result.json").exists()  # SIGKILLed before it could write one

    # where each run stopped, and from what each resumed
    r1, r3, r4, r5 = (result[n] for n in ("val_mid_window", "val_at_step", "epoch_end", "finish"))
    assert (r1["step"], r1["checkpoint"]) == (2, str(ckpt / name[2]))
    assert ["val", 0, -1, 1] in r1["events"] and r1["events"][-1] == ["train", 0, 3, 2]  # validation finished first
    assert r3["resumed_from"] == str(ckpt / name[2])  # not the killed step-3 save
    assert (r3["step"], r3["checkpoint"], r3["events"][-1]) == (3, str(ckpt / name[3]), ["val", 0, -1, 3])
    assert (r4["resumed_from"], r4["step"], r4["checkpoint"]) == (str(ckpt / name[3]), 6, str(ckpt / name[6]))
    assert r4["events"][-1] == ["train", 0, 11, 6]
    assert (r5["resumed_from"], r5["step"], r5["exit"]) == (str(ckpt / name[6]), 12, 0)
    # ExactResume went first; JITCheckpoint (listed before the EMA) and ExactResume's helper moved behind the others
    assert r1["order"][0] == "ExactResume"
    assert set(r1["order"][-2:]) == {"JITCheckpoint", "_ExactResumeTail"}
    # one file per completed save, nothing left over
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(name.values())
    for step, file in name.items():
        loaded = torch.load(ckpt / file, weights_only=True)
        assert loaded["global_step"] == step and loaded["callbacks"]["ExactResume"]["world_size"] == 1
    # the resumed chain ends with exactly the weights of the uninterrupted run
    expected = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    got = torch.load(tmp_path / "finish" / "final.pt", weights_only=True)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # reported, not asserted (a shared machine makes times noisy); a run that never exits fails in wait_json
    print(f"signal -> process exit (s): { {k: round(v, 2) for k, v in latency.items()} }")
