"""How the ``lit-trainer`` command's OpenMP threads wait: chosen from the load before torch is imported.

torch's CPU kernels run on OpenMP threads (libgomp in the Linux PyPI wheels), and by default a
thread that reaches the end of a parallel region spins, waiting for the others, for up to 300,000 iterations before it
sleeps. When other processes keep the cores busy, the spinning thread burns the time slice that the thread it waits
for needs, and a training step of a small model can take many times longer. libgomp reads its environment once, when
torch loads it, so the command chooses how threads wait before that, from the 1-minute load average:

* cores busy (load above the cores available): ``OMP_WAIT_POLICY=PASSIVE``, waiting threads sleep at once;
* otherwise: ``GOMP_SPINCOUNT=10000``, a wait spins 30 times less long than libgomp's default, still long enough to
  catch the other threads on a quiet machine.

Measured with ``benchmarks/busy_machine.py`` (docs/benchmarks.md): on a quiet machine the short spin is as fast as
libgomp's default and passive waits 5-10% slower; at load 18-19 on 2 cores passive waits are as fast as one thread and
the short spin 1.5-1.9x slower; libgomp's default was 5.4x slower than one thread at load 10-13. Why the waits and not
the thread count: waiting changes when threads sleep, never how work is split, so results are bit-identical whatever
the load (a choice from the load is safe for exact resume); a thread count chosen from the current load could change
float reductions between the first part of a run and its resumed part. A variable the user set
(``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``) is kept as is, and ``import lit_trainer`` alone changes
nothing. Other OpenMP runtimes (LLVM's libomp on macOS) ignore ``GOMP_SPINCOUNT``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

# Variables that already say how waiting OpenMP threads behave (libgomp, or Intel's OpenMP for KMP_BLOCKTIME).
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SHORT_SPIN = 10_000  # libgomp spin iterations before a waiting thread sleeps (its default: 300,000)


def openmp_defaults(environ: Mapping[str, str], load: float = 0.0, cores: int = 1) -> dict[str, str]:
    """The OpenMP variables the ``lit-trainer`` command sets: none when the user already chose how threads wait.

    Args:
        environ: the environment (a wait variable set there wins).
        load: the 1-minute load average when the command starts.
        cores: the cores this process may run on.

    Example:
        >>> openmp_defaults({}, load=0.3, cores=2)
        {'GOMP_SPINCOUNT': '10000'}
        >>> openmp_defaults({}, load=7.5, cores=2)
        {'OMP_WAIT_POLICY': 'PASSIVE'}
        >>> openmp_defaults({"OMP_WAIT_POLICY": "active"}, load=7.5, cores=2)
        {}
    """
    if any(environ.get(name) for name in WAIT_VARIABLES):
        return {}
    if load > cores:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": str(SHORT_SPIN)}


def _load_and_cores() -> tuple[float, int]:
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        load = 0.0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return load, cores


def apply_openmp_defaults(
    environ: MutableMapping[str, str] = os.environ, load: float | None = None, cores: int | None = None
) -> dict[str, str]:
    """Set :func:`openmp_defaults` in ``environ`` (before torch is imported) and return what was set; ``load`` and
    ``cores`` default to this machine's now."""
    measured_load, measured_cores = _load_and_cores()
    chosen = openmp_defaults(
        environ, measured_load if load is None else load, measured_cores if cores is None else cores
    )
    environ.update(chosen)
    return chosen
