"""Running the scripts under ``tests/scripts`` (2-rank DDP/FSDP runs, fault injection) and the ``lit-trainer`` console
script as separate processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = TESTS / "scripts"


def script_env(**extra: str) -> dict[str, str]:
    """This process's environment with one intra-op thread per process, quiet warnings, and ``tests/`` and
    ``tests/scripts/`` first on ``PYTHONPATH`` (so a script, and every rank Lightning starts from it, imports
    ``helpers`` and the scripts' shared modules); ``extra`` is added last."""
    path = os.pathsep.join(p for p in (str(TESTS), str(SCRIPTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path, **extra}


def run_script(name: str, *args: str | os.PathLike, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run ``tests/scripts/<name>`` with ``args`` to the end; its output is captured (see :func:`output_tail`)."""
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *map(str, args)],
        env=script_env(),
        timeout=timeout,
        capture_output=True,
        text=True,
    )


def run_lit_trainer(*args: str | os.PathLike, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """The ``lit-trainer`` console script installed next to this interpreter (else the one on ``PATH``) with ``args``,
    run to the end in ``cwd`` with one intra-op thread and ``extra`` added to the environment; output captured."""
    exe = Path(sys.executable).with_name("lit-trainer")
    return subprocess.run(
        [str(exe) if exe.exists() else "lit-trainer", *map(str, args)],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **extra},
        capture_output=True,
        text=True,
        timeout=900,
    )


def output_tail(proc: subprocess.CompletedProcess[str], chars: int = 3000) -> str:
    """The end of a finished script's stdout and stderr, for an assertion message."""
    return (proc.stdout or "")[-chars:] + (proc.stderr or "")[-chars:]


def launch_script(name: str, *args: str | os.PathLike, log: Path) -> subprocess.Popen:
    """Start ``tests/scripts/<name>`` with ``args`` in the background, stdout and stderr to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, str(SCRIPTS / name), *map(str, args)],
            env=script_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_json(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 150) -> dict:
    """The JSON object a running script writes to ``path``, once the file is complete.

    Polls until the file parses (a JSON object that is cut short never does), so a file read while it is being
    written is read again, however slow the machine. Fails the test, with the end of ``log``, if ``proc`` exits or
    ``timeout`` seconds pass first (a hang guard, not a speed requirement).
    """
    deadline = time.monotonic() + timeout
    while True:
        over = proc.poll() is not None or time.monotonic() > deadline  # before the read: one last read after an exit
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if over:
            proc.kill()
            pytest.fail(f"{path} did not appear (rc={proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a run's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_lit_trainer_ranks(*args: str | os.PathLike, cwd: Path, ranks: int = 2) -> list[subprocess.Popen]:
    """``lit-trainer`` with ``args`` started once per rank, in the background, as torchrun or Slurm start a run (each
    process gets ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``; Lightning then starts
    no process itself), so the caller holds every rank's pid and exit status. Environment as :func:`script_env`;
    rank ``r``'s output goes to ``cwd/rank<r>.log``."""
    exe = Path(sys.executable).with_name("lit-trainer")
    command = [str(exe) if exe.exists() else "lit-trainer", *map(str, args)]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
    procs = []
    for rank in range(ranks):
        env = script_env(**rendezvous, WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
        with open(cwd / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs
