"""Running the scripts under ``tests/scripts`` (2-rank DDP/FSDP runs, fault injection) and the ``lit-trainer`` console
script as separate processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Part:
    """One part of the shared 2-rank world: ``tests/scripts/<script> OUT args...``, checked by the tests of ``users``
    (test file names)."""

    script: str
    args: tuple[str, ...] = ()
    users: tuple[str, ...] = ()


#: the 2-rank scripts that share one world (``tests/scripts/ddp_world.py``), in the order they run there
WORLD: dict[str, Part] = {
    # first: its preset goes through a temporary folder before the fit, and once a process group is up (after a
    # part's fit) transformers writes a model on rank 0 only, so rank 1 would find an empty folder
    "qlora": Part("ddp_qlora.py", users=("test_qlora.py",)),
    "kto": Part("ddp_kto.py", users=("test_kto.py",)),
    "rloo": Part("ddp_rloo.py", users=("test_rloo.py",)),
    "grad_accum": Part("ddp_grad_accum.py", users=("test_ddp_grad_accumulation.py",)),
    "grad_accum_limit_1": Part("ddp_grad_accum.py", ("1",), users=("test_ddp_grad_accumulation.py",)),
    "grad_accum_padding_free": Part("ddp_grad_accum.py", ("-", "padding_free"), users=("test_packing.py",)),
    "grad_accum_padding_free_rebalance": Part(
        "ddp_grad_accum.py", ("-", "padding_free", "batch_rebalance"), users=("test_rebalance_packed.py",)
    ),
    "bema": Part("ddp_bema.py", users=("test_bema.py",)),
    "best_checkpoint": Part("ddp_best_checkpoint.py", users=("test_best_checkpoint.py",)),
    "plain_resume": Part("ddp_plain_resume.py", users=("test_exact_resume_ddp.py",)),
    "batch_rebalance": Part("ddp_batch_rebalance.py", users=("test_ddp_batch_rebalance.py",)),
    "dpo": Part("ddp_dpo.py", users=("test_dpo_module.py",)),
    "grpo": Part("ddp_grpo.py", users=("test_ddp_grpo.py",)),
    "grpo_options": Part("ddp_grpo_options.py", users=("test_ddp_grpo_options.py",)),
    "grpo_tools": Part("ddp_grpo_tools.py", users=("test_ddp_grpo_tools.py",)),
    "reward_ranks": Part("reward_ranks.py", users=("test_reward_ranks.py",)),
    "distill": Part("ddp_distill.py", users=("test_distillation.py",)),
    "fsdp_lora": Part("fsdp_lora.py", users=("test_fsdp_lora.py",)),
    "fsdp_grpo_tools": Part("fsdp_grpo_tools.py", users=("test_ddp_grpo_tools.py",)),
    "grpo_reward_model_ranks": Part("grpo_reward_model_ranks.py", users=("test_grpo_reward_models.py",)),
    "vision": Part("ddp_vision.py", users=("test_vision_training.py",)),
    "fsdp": Part("fsdp_train.py", users=("test_fsdp.py",)),
    "vision_rl": Part("ddp_vision_rl.py", users=("test_vision_ddp_rl.py",)),
}


def run_world(out: Path, parts: list[str], timeout: float = 1800) -> list[int]:
    """Run ``tests/scripts/ddp_world.py out *parts`` as 2 ranks started here (as torchrun starts them); rank ``r``'s
    output goes to ``out/rank<r>.log``. When one rank fails the other is stopped (it would wait in a collective).
    Returns the exit codes; ``timeout`` is a hang guard."""
    out.mkdir(parents=True, exist_ok=True)
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0", "WORLD_SIZE": "2"}
    procs = []
    for rank in range(2):
        with open(out / f"rank{rank}.log", "w") as log:
            command = [sys.executable, str(SCRIPTS / "ddp_world.py"), str(out), *parts]
            env = script_env(**rendezvous, LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(5)  # let the other rank write its own error, then stop it
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


class World:
    """The shared 2-rank world of one test session (the ``ddp_world`` fixture of ``tests/conftest.py``).

    The first :meth:`part` call runs every part the session's selected tests use, in ONE launch, under a file lock
    in ``root`` (shared by the pytest-xdist workers: the world runs once per session). A part that did not finish
    there (a failure stops the world at that part) runs its script alone for the test that asks for it, so its test
    fails with the script's own output, and the other parts' tests are unaffected.
    """

    def __init__(self, root: Path, parts: list[str]) -> None:
        self.root, self.parts = root, parts

    def _run_once(self) -> None:
        from filelock import FileLock

        with FileLock(str(self.root / "ddp_world.lock")):
            if not (self.root / "ddp_world.finished").exists():
                codes = run_world(self.root / "ddp_world", self.parts)
                (self.root / "ddp_world.finished").write_text(json.dumps({"parts": self.parts, "codes": codes}))

    def part(self, name: str) -> Path:
        """The folder where part ``name`` (a key of :data:`WORLD`) wrote its files."""
        if name in self.parts:
            self._run_once()
            out = self.root / "ddp_world" / name
            if all((out / f"done_rank{r}").exists() for r in (0, 1)):
                return out
        out = Path(tempfile.mkdtemp(prefix=f"{name}_alone_", dir=self.root))
        proc = run_script(WORLD[name].script, out, *WORLD[name].args)
        assert proc.returncode == 0, output_tail(proc)
        return out
