"""CPUThreadCheck: say once when torch's CPU threads compete with other processes for the cores.

torch runs its CPU kernels on ``torch.get_num_threads()`` OpenMP threads (one per core by default). When other
processes keep the cores busy and OpenMP's waiting threads spin (libgomp's default), each parallel region waits for
its slowest thread to get a core while the others burn the cores it needs, and a step can take 5-15 times longer
than on a quiet machine (``configs/sft.yaml`` at its former 1,500 steps: about a minute quiet, 7 to 33 minutes on a
busy 2-core machine).

The ``lit-trainer`` command therefore sets ``GOMP_SPINCOUNT=10000`` before torch loads (``lit_trainer.cli.openmp``:
waiting threads spin briefly, then sleep; results unchanged), and the busy-machine cost then stays close to one
thread's (``benchmarks/busy_machine.py``). The warning is for the remaining case: torch imported with long spinning
waits (a library user's own script, or ``OMP_WAIT_POLICY=ACTIVE``) on oversubscribed cores.

The check is cheap and stable: once, after ``after_steps`` optimizer steps, it compares the 1-minute load average
(runnable threads, ours included) with the number of cores. It warns only when torch uses more than one thread, its
waiting threads spin, and the load exceeds the cores by more than ``margin``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_trainer.cli.openmp import SHORT_SPIN


def waits_passively(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether waiting OpenMP threads sleep at once or after a short spin (``OMP_WAIT_POLICY=PASSIVE``, or
    ``GOMP_SPINCOUNT`` at most the ``lit-trainer`` command's 10,000), so oversubscribed cores do not stall them.

    OpenMP reads these when torch loads it, so this is right when they were set before ``import torch`` (as the
    ``lit-trainer`` command does).

    Example:
        >>> waits_passively({"OMP_WAIT_POLICY": "passive"}), waits_passively({"GOMP_SPINCOUNT": "10000"})
        (True, True)
        >>> waits_passively({}), waits_passively({"GOMP_SPINCOUNT": "300000"})
        (False, False)
    """
    if environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return True
    spin = environ.get("GOMP_SPINCOUNT", "").strip()
    return spin.isdigit() and int(spin) <= SHORT_SPIN


def oversubscription_warning(
    cpu_count: int,
    torch_threads: int,
    load_1min: float,
    seconds_per_step: float,
    margin: float = 0.5,
    passive: bool = False,
) -> str | None:
    """The warning to show, or ``None`` when the cores are not oversubscribed.

    Args:
        cpu_count: cores available to this process.
        torch_threads: ``torch.get_num_threads()``.
        load_1min: ``os.getloadavg()[0]``: runnable threads averaged over a minute, this process's included.
        seconds_per_step: measured wall time per optimizer step (shown in the message).
        margin: load above ``cpu_count`` that is still tolerated (noise, short-lived processes).
        passive: waiting OpenMP threads sleep at once or after a short spin (:func:`waits_passively`): then
            nothing to warn about.

    Example:
        >>> oversubscription_warning(2, 2, 1.9, 0.05) is None
        True
        >>> "OMP_NUM_THREADS=1" in oversubscription_warning(2, 2, 4.0, 0.5)
        True
    """
    if passive or torch_threads <= 1 or load_1min <= cpu_count + margin:
        return None
    return (
        f"Training is likely slowed down by CPU oversubscription: torch uses {torch_threads} threads on "
        f"{cpu_count} cores while the load average is {load_1min:.1f} ({seconds_per_step:.3f} s per step so "
        "far), and its waiting OpenMP threads spin, taking the cores from the threads they wait for. Set "
        "GOMP_SPINCOUNT=10000 before torch is imported (the `lit-trainer` command's default; same results), "
        "or run with OMP_NUM_THREADS=1 (or call torch.set_num_threads(1) before training), or give the job cores "
        "of its own."
    )


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class CPUThreadCheck(Callback):
    """Warn once, after ``after_steps`` optimizer steps of a CPU run, when the cores are oversubscribed.

    Args:
        after_steps: optimizer steps before the check (so the measured step time is past the warm-up).
    """

    def __init__(self, after_steps: int = 20) -> None:
        self.after_steps = after_steps
        self._start: tuple[float, int] | None = None
        self.message: str | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = (time.monotonic(), trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if self._start is None or trainer.global_step - self._start[1] < self.after_steps:
            return
        started, first_step = self._start
        self._start = None  # once
        if trainer.strategy.root_device.type != "cpu" or not hasattr(os, "getloadavg"):
            return
        seconds = (time.monotonic() - started) / max(trainer.global_step - first_step, 1)
        threads, load = torch.get_num_threads(), os.getloadavg()[0]
        self.message = oversubscription_warning(_cores(), threads, load, seconds, passive=waits_passively())
        if self.message:
            rank_zero_warn(self.message)
