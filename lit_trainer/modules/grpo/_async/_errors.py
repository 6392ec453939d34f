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


def death_message(pid: int | None, exitcode: int | None) -> str:
    """The error of a worker that died without reporting an error. Only a SIGKILL, which leaves no traceback, suggests
    running out of memory (the kernel's OOM killer sends it); any other exit points at what the worker printed."""
    if exitcode == -signal.SIGKILL:
        return (
            f"The GRPO rollout worker (pid {pid}) was killed by SIGKILL (out of memory?): rerun with a smaller "
            "generation batch, or without max_staleness."
        )
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {-exitcode}"
        if -exitcode in signal.valid_signals():
            how = f"was killed by {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return (
        f"The GRPO rollout worker (pid {pid}) {how} without reporting an error: the traceback it printed, if any, is "
        "in the training process's error output (stderr)."
    )
