"""Asynchronous GRPO resumes exactly at ``max_staleness > 0``: the rounds in flight at a checkpoint are regenerated
after the resume with the weights versions they would have been sampled with (the checkpoint carries them), so the
final weights are bit-equal to an uninterrupted run's (``torch.equal``, CPU, the default ``generate`` engine) and
``async/staleness`` goes on as in that run. Stopped by ``max_steps`` here (at a round's end, inside a round, with the
rounds in flight crossing an epoch's end, under LoRA), by a SIGTERM through ``JITCheckpoint``, and by SIGKILL after a
checkpoint (the script of ``tests/test_grpo_async_shutdown.py``). A checkpoint without the versions still loads, with a
warning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from test_grpo_async import fit, logged
from test_grpo_async_paths import LORA
from test_grpo_module import QUIET, data, grpo

from helpers.ddp import SCRIPTS, script_env
from helpers.signals import SignalAt
from lit_trainer.callbacks import ExactResume, JITCheckpoint
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit

pytestmark = pytest.mark.slow  # each case starts rollout workers (the first in a process: ~10 s of CPU)

STATE_KEY = "grpo_async_rollouts"  # the checkpoint's key (lit_trainer.modules.grpo._async.STATE_KEY)
FRESHER = "without the weights versions that sampled the rounds in flight"


def token_sum_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    """A reward that differs within nearly every group (the sum of the ids modulo 7): every round's advantages are
    non-zero, so the weights that sampled it (through its completions and importance-sampling ratio) reach the final
    weights. (With the tests' ``length_reward`` most rounds of these short runs have zero advantages.)"""
    return [float(sum(ids) % 7) for ids in completion_ids]


def _trainable(module: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


def _per_step(root: Path, column: str) -> dict[int, float]:
    log = logged(root)
    rows = log[["step", column]].dropna()
    return dict(zip(rows["step"].astype(int), rows[column]))


@pytest.mark.parametrize(
    ("k", "stop", "steps", "options"),
    [
        pytest.param(1, 3, 6, {}, id="k1"),
        # 8 micro-steps an epoch: the rounds in flight at step 7 are read ahead across the epoch's end
        pytest.param(2, 7, 10, {}, id="k2-across-epochs"),
        # a round is 2 optimizer steps: the checkpoint at step 3 is inside round 1 (its buffer is in the checkpoint)
        pytest.param(2, 3, 6, {"steps_per_generation": 2}, id="k2-mid-round"),
        pytest.param(1, 3, 5, {"peft_config": LORA, "steps_per_generation": 2}, id="k1-lora-mid-round"),
    ],
)
def test_resume_at_max_staleness_k_is_the_uninterrupted_run(
    tmp_path: Path, k: int, stop: int, steps: int, options: dict
):
    options = {"reward_funcs": [token_sum_reward], **options}
    uninterrupted = fit(steps, tmp_path / "whole", max_staleness=k, **options)
    fit(stop, tmp_path / "first", every=stop, max_staleness=k, **options)
    checkpoint = tmp_path / "first" / f"epoch={stop // 8}-step={stop}.ckpt"
    resumed = fit(steps, tmp_path / "resumed", ckpt_path=str(checkpoint), max_staleness=k, **options)

    saved = torch.load(checkpoint, weights_only=True)
    whole, after = _trainable(uninterrupted), _trainable(resumed)
    at_stop = {n: saved["state_dict"][f"model.{n}"] for n in whole}
    assert any(not torch.equal(whole[n], at_stop[n]) for n in whole)  # the weights moved after the checkpoint
    for name in whole:
        assert torch.equal(whole[name], after[name]), name
    staleness = _per_step(tmp_path / "whole", "async/staleness")
    resumed_staleness = _per_step(tmp_path / "resumed", "async/staleness")
    assert resumed_staleness and resumed_staleness == {s: v for s, v in staleness.items() if s >= stop}
    assert max(resumed_staleness.values()) == k  # not the fresher 0, 1, ... of a resume without the versions
    assert not any(_per_step(tmp_path / "resumed", "async/resampled_rounds").values())

    # the checkpoint holds the trainable weights (LoRA: the adapters) of the versions the next rounds still read
    state = saved[STATE_KEY]
    names = set(_trainable(resumed))
    assert state["first"] == 0 and state["versions"]
    assert all(set(v) == names for v in state["versions"].values())
    assert len(state["versions"]) == min(k, state["next_round"])
    if "peft_config" in options:
        assert all("lora_" in n for n in names)


def test_a_checkpoint_without_the_versions_still_loads_with_a_warning(tmp_path: Path):
    """A checkpoint written before the versions were kept (the key removed here): the resume samples its first round
    with the resumed weights (staleness 0, then k), and says so once."""
    fit(2, tmp_path / "first", every=2, max_staleness=1, reward_funcs=[token_sum_reward])
    checkpoint = torch.load(tmp_path / "first" / "epoch=0-step=2.ckpt", weights_only=False)
    checkpoint.pop(STATE_KEY, None)  # what an older version wrote: no weights versions
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match=FRESHER) as caught:
        fit(
            4,
            tmp_path / "resumed",
            ckpt_path=str(tmp_path / "old.ckpt"),
            max_staleness=1,
            reward_funcs=[token_sum_reward],
        )
    assert sum(FRESHER in str(w.message) for w in caught) == 1
    assert list(_per_step(tmp_path / "resumed", "async/staleness").values()) == [0.0, 1.0]


def _fit_with(steps: int, root: Path, callbacks: list, ckpt_path: str | None = None, **options: Any) -> Any:
    """:func:`test_grpo_async.fit` with the recipes' ``ExactResume`` and ``JITCheckpoint`` (saving at the first step
    boundary after a signal: ``kill_wait=0``) and more ``callbacks``."""
    L.seed_everything(0)
    trainer_options = {**QUIET, "logger": CSVLogger(root, name="log"), **options.pop("trainer", {})}
    module = grpo(reward_funcs=[token_sum_reward], **options)
    callbacks = [ExactResume(), JITCheckpoint(kill_wait=0.0), *callbacks]
    trainer = L.Trainer(
        max_steps=steps, callbacks=callbacks, log_every_n_steps=1, default_root_dir=root, **trainer_options
    )
    trainer.fit(module, datamodule=data(n=16, batch_size=8), ckpt_path=ckpt_path)
    return module


def test_a_sigterm_through_jit_checkpoint_resumes_exactly(tmp_path: Path):
    """max_staleness=2: a SIGTERM at the end of step 3 (``JITCheckpoint`` saves that step's boundary, the worker
    holding rounds 4 and 5 in flight), resumed to step 6: the uninterrupted run's weights and staleness."""
    uninterrupted = _fit_with(6, tmp_path / "whole", [], max_staleness=2)
    with pytest.raises(JITCheckpointExit) as stopped:
        _fit_with(6, tmp_path / "first", [SignalAt(3)], max_staleness=2)
    assert Path(stopped.value.checkpoint_path).name == "last-jit-epoch=0-step=3.ckpt"
    resumed = _fit_with(6, tmp_path / "resumed", [], ckpt_path=stopped.value.checkpoint_path, max_staleness=2)
    whole, after = _trainable(uninterrupted), _trainable(resumed)
    for name in whole:
        assert torch.equal(whole[name], after[name]), name
    staleness = _per_step(tmp_path / "whole", "async/staleness")
    assert _per_step(tmp_path / "resumed", "async/staleness") == {s: v for s, v in staleness.items() if s >= 3}
    assert max(staleness.values()) == 2


# ------------------------------------------------------------------------------------------- stopped from outside
#: hang guards (seconds) for the script's start and its runs on a loaded machine; not speed requirements
START_GUARD, RUN_GUARD = 240.0, 300.0
TOTAL = 8  # optimizer steps of every run below


def _launch(out: Path, *args: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fit.log", "w") as f:
        command = [sys.executable, str(SCRIPTS / "grpo_async_fit.py"), str(out), "k=2", "record", *args]
        return subprocess.Popen(command, env=script_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, out: Path, timeout: float = RUN_GUARD) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{out.name} did not end within {timeout} s:\n{(out / 'fit.log').read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _step(checkpoint: Path) -> int:
    return int(torch.load(checkpoint, weights_only=False)["global_step"])


def test_a_run_killed_after_a_checkpoint_resumes_exactly(tmp_path: Path):
    """max_staleness=2, 8 optimizer steps, run by ``tests/scripts/grpo_async_fit.py``: SIGKILLed with its worker and
    forkserver (as the OOM killer or a lost node would) after two checkpoints of a checkpoint every step, then resumed
    from the older one (the newer may be half written) to the end: the final trainable weights and every step's
    ``async/staleness`` equal the uninterrupted run's."""
    whole = tmp_path / "whole"
    assert _finish(_launch(whole, f"steps={TOTAL}"), whole) == 0

    killed = tmp_path / "killed"
    proc = _launch(killed, "slow", "every=1")  # a round a second: killed well before the end
    deadline = time.monotonic() + START_GUARD
    saved: list[Path] = []
    while len(saved) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        saved = sorted((killed / "checkpoints").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    os.killpg(proc.pid, signal.SIGKILL)
    _finish(proc, killed)
    assert len(saved) >= 3, (killed / "fit.log").read_text()[-3000:]
    checkpoint = saved[-2]
    assert 2 <= _step(checkpoint) < TOTAL - 2

    last = tmp_path / "resumed"
    assert _finish(_launch(last, f"steps={TOTAL}", f"ckpt={checkpoint}"), last) == 0, (last / "fit.log").read_text()

    reference = torch.load(whole / "trainable.pt", weights_only=True)
    resumed = torch.load(last / "trainable.pt", weights_only=True)
    assert reference.keys() == resumed.keys()
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name
    staleness = json.loads((whole / "staleness.json").read_text())
    assert staleness == {str(s): min(s, 2) for s in range(TOTAL)}
    ran = json.loads((last / "staleness.json").read_text())  # the steps after the checkpoint
    assert sorted(ran) == [str(s) for s in range(_step(checkpoint), TOTAL)]
    assert all(staleness[s] == v for s, v in ran.items()), ran
