"""How the training process reports a rollout worker that failed or died: the cause in the first line."""

from __future__ import annotations

import signal


def failure_message(pid: int | None, round_index: int, worker_traceback: str) -> str:
    """The error of a worker that reported a failure (``round_index`` -1: it failed to start): the traceback's last
    line, the exception, then the whole traceback.

    Example: for a traceback ending in ``ModuleNotFoundError: No module named 'x'`` and round -1 the message starts
    ``The GRPO rollout worker (pid 7) failed to start: ModuleNotFoundError: No module named 'x'``.
    """
    lines = worker_traceback.strip().splitlines()
    cause = lines[-1] if lines else "no traceback"
    where = "failed to start" if round_index < 0 else f"failed on round {round_index}"
    return f"The GRPO rollout worker (pid {pid}) {where}: {cause}\n\nThe worker's traceback:\n{worker_traceback}"


class WorkerDied(RuntimeError):
    """The rollout worker process ended without reporting an error; the message (one line) says how, from its exit
    status (:func:`death_message`)."""


def death_message(pid: int | None, exitcode: int | None, round_index: int) -> str:
    """One line on a worker that died without reporting an error, from its exit status alone: the signal that killed
    it, or its exit code. SIGKILL leaves no traceback and comes from outside the worker (``kill -9``, a scheduler, or
    the kernel's out-of-memory killer, whose kill the kernel log records): the message says so, without guessing.

    Example: ``death_message(7, -9, 3)`` starts ``"The GRPO rollout worker (pid 7) was killed by signal 9 (SIGKILL)
    at round 3"``.
    """
    if exitcode is not None and exitcode < 0:
        number = -exitcode
        name = signal.Signals(number).name if number in signal.valid_signals() else "unknown signal"
        how = f"was killed by signal {number} ({name})"
    else:
        how = f"exited with code {exitcode}"
    if exitcode == -signal.SIGKILL:
        why = (
            "SIGKILL leaves no traceback and comes from outside the worker: `kill -9`, a scheduler, or the kernel's "
            "out-of-memory killer (the kernel log, `dmesg`, records its kills)"
        )
    else:
        why = "the traceback it printed, if any, is above on stderr"
    return f"The GRPO rollout worker (pid {pid}) {how} at round {round_index} without reporting an error; {why}."
