"""Asynchronous GRPO leaves no orphan process: a training process stopped by SIGTERM (a scheduler), Ctrl-C
(SIGINT) or SIGKILL (the OOM killer) takes its rollout worker with it.

SIGKILL leaves the trainer no chance to act: the worker must notice by itself that its parent is gone. That loop is
tested on a worker started from a forked copy of this test process (nothing to import, so it costs a second, not the
~20 s of CPU a real trainer and its forkserver take to start), which is then killed.

Each case runs ``tests/scripts/grpo_async_fit.py`` (an async fit of hours, with the recipes' ``JITCheckpoint``) in its
own process group, waits until the worker has delivered a round, checks that the worker runs below that trainer, sends
the signal (to the trainer alone, or to the whole group as a terminal's Ctrl-C or Slurm's time limit does: the worker,
its forkserver and the resource tracker get it too), and then requires every process below the trainer to be gone.
The time limits are hang guards, not speed requirements: the worker polls its parent every 0.5 s, and the trainer
gives it 5 s to stop before killing it. A reward function that fails mid-run (the in-process case) is in
``test_grpo_async_paths.py``, where it shares a fit with the LoRA sampler check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from helpers.ddp import SCRIPTS, script_env, wait_json

pytestmark = pytest.mark.slow  # a trainer and its forkserver each import torch and Lightning: ~13 s of CPU a case

#: hang guards (seconds): the worker's start (imports) under a loaded machine, the save and exit, the worker's exit
START_GUARD, EXIT_GUARD, GONE_GUARD = 240.0, 60.0, 30.0


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...), or None when ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie, exited and waiting to be reaped, has exited)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _descendants(pid: int) -> set[int]:
    """The running processes below ``pid``: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        stat = _stat(int(entry)) if entry.isdigit() else None
        if stat is not None and stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _left(pids: set[int], timeout: float) -> set[int]:
    """The processes of ``pids`` still running after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := {p for p in pids if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _launch(out: Path, log: Path, *args: str) -> subprocess.Popen:
    """``grpo_async_fit.py OUT *args`` in its own session, so that its process group holds the trainer and everything
    it starts, as a terminal's foreground job or a Slurm job step does (output to ``log``)."""
    with open(log, "w") as f:
        command = [sys.executable, str(SCRIPTS / "grpo_async_fit.py"), str(out), *args]
        return subprocess.Popen(command, env=script_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.parametrize(
    ("signum", "to_group", "code"),
    [
        # Slurm at the time limit or scancel: every process of the step, while the trainer waits for the worker (the
        # worker and its forkserver ignore SIGTERM, so the trainer saves first; a SIGTERM to the trainer alone, as
        # Kubernetes or `kill PID` send it, takes the same path in the trainer)
        pytest.param(signal.SIGTERM, True, 143, id="sigterm-to-group"),
        pytest.param(signal.SIGINT, True, 130, id="ctrl-c"),  # a terminal: the whole foreground process group
    ],
)
def test_a_stopped_trainer_leaves_no_rollout_worker(tmp_path: Path, signum: signal.Signals, to_group: bool, code: int):
    log = tmp_path / "fit.log"
    # for the job-wide SIGTERM the worker samples slowly, so the signal finds the trainer waiting for it
    proc = _launch(tmp_path, log, *(["slow"] if signum == signal.SIGTERM and to_group else []))
    below: set[int] = set()
    try:
        started = wait_json(tmp_path / "started.json", proc, log, START_GUARD)
        assert started["pid"] == proc.pid
        # the worker runs, below the trainer (forked from its forkserver), beside the forkserver and resource tracker
        below = _descendants(proc.pid)
        assert started["worker"] in below and _running(started["worker"]), below
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        try:
            assert proc.wait(EXIT_GUARD) == code, log.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer did not exit within {EXIT_GUARD} s:\n{log.read_text()[-3000:]}")
        # after SIGKILL nothing stops them: the worker must notice its parent's death (it polls) and exit by itself
        left = _left(below, GONE_GUARD)
        assert not left, f"still running after the trainer exited: {[(p, _stat(p)) for p in left]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in below:  # never leave one behind, even when the test failed
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    folder = tmp_path / "checkpoints"
    saved = sorted(p.name for p in folder.glob("*.ckpt")) if folder.exists() else []
    assert len(saved) == 1 and saved[0].startswith("last-jit-epoch="), saved  # the step after the signal


def _start_worker_then_sleep(spec: Any, requests: Any, results: Any, weights: Any) -> None:
    """The forked stand-in for a training process: start a worker (as a trainer does), then wait to be killed."""
    import multiprocessing

    from lit_trainer.modules.grpo._async._worker import worker_main

    multiprocessing.get_context("fork").Process(target=worker_main, args=(spec, requests, results, weights)).start()
    time.sleep(600)


def test_a_worker_exits_by_itself_when_its_trainer_is_killed():
    import multiprocessing

    import transformers

    from helpers.models import tiny_llama
    from lit_trainer.modules.grpo import GRPOModule
    from lit_trainer.modules.grpo._async._worker import SharedWeights, WorkerSpec

    context = multiprocessing.get_context("fork")
    model = tiny_llama(0)
    spec = WorkerSpec(
        module_class=GRPOModule, model=model, tokenizer=transformers.ByT5Tokenizer(), hparams={"num_generations": 2},
        tools=[], environments=None, continuous_batching=False, engine=None, steps_per_generation=1, device="cpu",
        threads=1,
    )  # fmt: skip
    weights = SharedWeights({n: p.detach() for n, p in model.named_parameters()}, slots=1)
    requests, results = context.Queue(), context.Queue()
    trainer = context.Process(target=_start_worker_then_sleep, args=(spec, requests, results, weights))
    trainer.start()
    try:
        _, status, worker = results.get(timeout=60)
        assert status == "started" and _running(worker)
        time.sleep(1.0)  # the worker is in its loop, waiting for requests
        assert _running(worker)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(10)
        assert not _left({worker}, 10.0), "the worker outlived its killed parent"  # it polls every 0.5 s
    finally:
        if trainer.is_alive():
            trainer.kill()
        if "worker" in locals() and _running(worker):
            os.kill(worker, signal.SIGKILL)
