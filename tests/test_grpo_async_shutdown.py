"""Asynchronous GRPO leaves no orphan process: a training process stopped by SIGTERM (a scheduler), Ctrl-C
(SIGINT) or SIGKILL (the OOM killer) takes its rollout worker with it.

SIGKILL leaves the trainer no chance to act: the worker must notice by itself that its parent is gone. That is tested
on a worker started from a forked copy of this test process (nothing to import, so it costs a second, not the ~20 s of
CPU a real trainer and its forkserver take to start), which is then killed: while the worker waits for a request, in
the middle of a long round's generation, and while the round is stuck in code that checks nothing.

Each case below that runs ``tests/scripts/grpo_async_fit.py`` (an async fit of hours, with the recipes'
``JITCheckpoint``) does so in its own process group, waits until the worker has delivered a round, checks that the
worker runs below that trainer, sends the signal (to the trainer alone, or to the whole group as a terminal's Ctrl-C or
Slurm's time limit does: the worker, its forkserver and the resource tracker get it too), and then requires every
process below the trainer to be gone. Those time limits are hang guards, not speed requirements: a thread in the
worker ends it as soon as its parent is gone, and the trainer gives it 5 s to stop before killing it. A reward function
that fails mid-run (the in-process case) is in ``test_grpo_async_paths.py``, where it shares a fit with the LoRA sampler
check.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.ddp import SCRIPTS, script_env, wait_json

pytestmark = pytest.mark.slow  # a trainer and its forkserver each import torch and Lightning: ~13 s of CPU a case

#: hang guards (seconds): the worker's start (imports) under a loaded machine, the save and exit, the worker's exit
START_GUARD, EXIT_GUARD, GONE_GUARD = 240.0, 60.0, 30.0
#: how soon a worker must be gone once its trainer is killed (measured 0.1-0.2 s: a thread waits for the parent)
EXIT_BOUND = 5.0


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
        # after SIGKILL nothing stops them: the worker must notice its parent's death and exit by itself
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


def test_a_killed_worker_saves_the_last_step_says_why_in_one_line_and_the_run_continues(tmp_path: Path):
    """The worker SIGKILLed while the trainer waits for its round (issue 47, item 4: the run stopped with a 70-line
    traceback, "out of memory?" and no checkpoint): the last finished optimizer step is saved, the run stops with one
    line naming the worker, the signal and the round (exit status 1, no traceback), and the checkpoint continues."""
    log = tmp_path / "fit.log"
    proc = _launch(tmp_path, log, "slow")  # the trainer waits for the worker nearly all the time
    try:
        started = wait_json(tmp_path / "started.json", proc, log, START_GUARD)
        os.kill(started["worker"], signal.SIGKILL)
        try:
            code = proc.wait(EXIT_GUARD)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer did not exit within {EXIT_GUARD} s:\n{log.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 1 and "Traceback" not in text, text[-3000:]
    pid = started["worker"]
    cause = [line for line in text.splitlines() if f"The GRPO rollout worker (pid {pid})" in line]
    assert len(cause) == 1, text[-3000:]
    found = re.search(r"was killed by signal 9 \(SIGKILL\) at round (\d+) without reporting an error", cause[0])
    assert found is not None, cause[0]
    saved = sorted((tmp_path / "checkpoints").glob("last-jit-*.ckpt"))
    assert len(saved) == 1, saved
    step = torch.load(saved[0], weights_only=False)["global_step"]
    assert step == int(found.group(1)) >= 1  # round r starts optimizer step r: steps 0..r-1 finished and were saved

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    proc = _launch(resumed, tmp_path / "resumed.log", f"steps={step + 2}", f"ckpt={saved[0]}")
    try:
        assert proc.wait(START_GUARD) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json.loads((resumed / "done.json").read_text()) == {"global_step": step + 2}


def _start_worker_then_sleep(spec: Any, requests: Any, results: Any, weights: Any, request: Any) -> None:
    """The forked stand-in for a training process: start a worker and send it its spec, weights and ``request`` (if
    any) as a trainer does, in that order from one queue, then wait to be killed."""
    import multiprocessing

    from lit_trainer.modules.grpo._async._worker import worker_main

    multiprocessing.get_context("fork").Process(target=worker_main, args=(requests, results)).start()
    requests.put((spec, weights))  # after the start, as a trainer does (its queue's thread must not run at the fork)
    if request is not None:
        requests.put(request)
    time.sleep(600)


def _cpu_seconds(pid: int) -> float:
    """CPU time ``pid`` has used so far (user + system), 0 when it is gone."""
    stat = _stat(pid)
    return 0.0 if stat is None else (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def _round(rows: int, tokens: int, engine: str | None = None) -> tuple[Any, Any, Any]:
    """``(spec, weights, request)`` of a worker round of ``rows`` completions of exactly ``tokens`` tokens each
    (``min_new_tokens``: no early EOS) from a tiny Llama, its weights published as version 0."""
    import transformers

    from helpers.models import tiny_llama
    from lit_trainer.data.prompt import PROMPT_IDS, PROMPT_MASK, PROMPTS, RolloutGeometry
    from lit_trainer.modules.grpo import GRPOModule
    from lit_trainer.modules.grpo._async._worker import RoundRequest, SharedWeights
    from lit_trainer.rewards import format_reward

    tokenizer, model = transformers.ByT5Tokenizer(), tiny_llama(0, hidden=64, positions=tokens + 16)
    module = GRPOModule(
        model, tokenizer=tokenizer, reward_funcs=[format_reward], num_generations=8, max_completion_length=tokens,
        generation_kwargs={"min_new_tokens": tokens}, generation_seed=0, rollout_engine=engine,
        rollout_worker_threads=1,
    )  # fmt: skip
    module.rollout_geometry = RolloutGeometry(8, 1, rows, 1)  # what setup sets: one micro-batch per round
    spec = module.async_rollouts.worker_spec(module, model, "cpu")
    weights = SharedWeights({n: p.detach() for n, p in model.named_parameters()}, slots=1)
    weights.publish(0, dict(model.named_parameters()))
    ids = torch.tensor([tokenizer("12+11=").input_ids[:-1]] * rows)  # without the tokenizer's EOS
    batch = {PROMPTS: ["12+11="] * rows, PROMPT_IDS: ids, PROMPT_MASK: torch.ones_like(ids)}
    return spec, weights, RoundRequest(0, 0, batch, seed=0)


def _kill_trainer_while_busy(spec: Any, weights: Any, request: Any, busy: Any) -> float:
    """Start a worker from a forked stand-in trainer, send it ``request`` (if any), wait until ``busy(worker pid)``
    (the round is under way), SIGKILL the trainer, and return the seconds the worker took to exit (it must not deliver
    the round)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    requests, results = context.Queue(), context.Queue()
    trainer = context.Process(target=_start_worker_then_sleep, args=(spec, requests, results, weights, request))
    trainer.start()
    worker = None
    try:
        _, status, worker = results.get(timeout=60)
        assert status == "started" and _running(worker)
        deadline = time.monotonic() + START_GUARD
        while not busy(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy(worker) and _running(worker), "the worker never got under way with the round"
        os.kill(trainer.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert not _left({worker}, GONE_GUARD), "the worker outlived its killed parent"
        exited = time.monotonic() - killed
        with pytest.raises(queue.Empty):  # it was killed mid-round: the round never came
            results.get(timeout=0.5)
        return exited
    finally:
        if trainer.is_alive():
            trainer.kill()
        if worker is not None and _running(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_exits_by_itself_when_its_trainer_is_killed():
    """Between rounds: the worker is waiting for a request when its trainer is killed."""
    spec, weights, _ = _round(rows=2, tokens=4)
    started = time.monotonic()
    assert _kill_trainer_while_busy(spec, weights, None, lambda pid: time.monotonic() > started + 1.0) < EXIT_BOUND


def test_a_worker_exits_at_once_when_its_trainer_is_killed_mid_round():
    """In the middle of a round's generation (the reported case: a 512x200 round outlived its trainer by 43.7 s): the
    worker's trainer is killed once it has computed for a second, and it exits within ``EXIT_BOUND`` (measured: 0.1-0.2
    s); the same round, run here on one thread as the worker runs it, is still generating after ``2 * EXIT_BOUND``
    (measured: 117 tokens in 10 s on one 2-core machine, and all of a 400-token round in under 10 s on a faster one,
    hence 2,000 tokens: a round that long outlasts 10 s on a machine 15 times faster than the first, and only the
    tokens generated within those 10 s take memory)."""
    spec, weights, request = _round(rows=512, tokens=2000)
    exited = _kill_trainer_while_busy(spec, weights, request, lambda pid: _cpu_seconds(pid) > 1.0)
    assert exited < EXIT_BOUND, exited

    from lit_trainer.modules.grpo._async._worker import WorkerRounds

    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        worker, started = WorkerRounds(spec), time.monotonic()  # the worker's model and rollout generator
        cut = lambda: time.monotonic() - started > 2 * EXIT_BOUND  # ends the generation early
        batch, seed = request.batch, request.seed
        rows = worker.rollouts.sample_round(worker.model, batch, seed, device=worker.device, should_stop=cut).rows
    finally:
        torch.set_num_threads(threads)
    assert rows["completion_ids"].shape[1] < 2000, f"all 2000 tokens in under {2 * EXIT_BOUND} s: make the round longer"


def test_a_worker_exits_at_once_when_its_trainer_is_killed_in_code_that_checks_nothing():
    """A round stuck where nothing is checked (an engine that sleeps, as a tool waiting on a server would): the worker
    still exits at once, whatever it is doing."""
    spec, weights, request = _round(rows=2, tokens=4, engine="helpers.engines.Sleeping")
    started = time.monotonic()
    exited = _kill_trainer_while_busy(spec, weights, request, lambda pid: time.monotonic() > started + 2.0)
    assert exited < EXIT_BOUND, exited
