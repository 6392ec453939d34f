"""Entry of the ``lit-trainer`` console script: OpenMP defaults that must be set before torch is imported.

torch's CPU kernels run on OpenMP threads (libgomp in the PyPI wheels), and by default a thread that reaches the end
of a parallel region spins, waiting for the others, for up to about 300,000 iterations before it sleeps. On a quiet
machine that saves a wake-up per region; when other processes keep the cores busy, the spinning thread burns the
time slice that the thread it waits for needs, and a training step of a small model can take many times longer
(``benchmarks/busy_machine.py``). ``OMP_WAIT_POLICY=PASSIVE`` makes waiting threads sleep at once.

Why the wait policy and not the thread count: the wait policy changes when threads sleep, never how work is split,
so results are bit-identical whatever the load; a thread count chosen from the current load could change float
reductions between the first part of a run and its resumed part and break exact resume. libgomp reads its
environment once, when torch loads it, so this module imports nothing from ``lit_trainer`` (whose ``__init__``
imports torch) before setting it. Only the ``lit-trainer`` command does this; ``import lit_trainer`` changes nothing.
A variable the user set (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``) is kept as is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

# Variables that already say how waiting OpenMP threads behave (libgomp, or Intel's OpenMP for KMP_BLOCKTIME).
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def openmp_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP variables the ``lit-trainer`` command sets: none when the user already chose how threads wait.

    Example:
        >>> openmp_defaults({})
        {'OMP_WAIT_POLICY': 'PASSIVE'}
        >>> openmp_defaults({"OMP_WAIT_POLICY": "active"})
        {}
    """
    if any(environ.get(name) for name in WAIT_VARIABLES):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :func:`openmp_defaults` in ``environ`` (before torch is imported) and return what was set."""
    chosen = openmp_defaults(environ)
    environ.update(chosen)
    return chosen


def main() -> None:
    """``lit-trainer``: apply the OpenMP defaults, then run :func:`lit_trainer.cli.main`."""
    apply_openmp_defaults()
    from lit_trainer.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
