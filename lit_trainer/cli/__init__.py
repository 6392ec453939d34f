"""The ``lit-trainer`` command in one package: how it parses a recipe, picks a run folder and a checkpoint.

* :mod:`~lit_trainer.cli.entry`: the console script's first stage (fast ``--help``, OpenMP defaults before torch);
* :mod:`~lit_trainer.cli.app`: :class:`LitTrainerCLI`, the LightningCLI subclass, and :func:`main`;
* :mod:`~lit_trainer.cli.runs`: run names, version folders (reserved atomically) and the appending CSV logger;
* which run wrote a checkpoint and which one ``--ckpt_path last`` takes, the newest complete checkpoint and the
  ``never | auto | <path>`` choice are callbacks-level code (:mod:`lit_trainer.callbacks.run_identity`,
  :mod:`lit_trainer.callbacks.resume_choice`), usable without the command;
* :mod:`~lit_trainer.cli.errors`, :mod:`~lit_trainer.cli.noise`, :mod:`~lit_trainer.cli.trackers`,
  :mod:`~lit_trainer.cli.openmp`, :mod:`~lit_trainer.cli.cpu_threads`: messages, quieted warnings, ``--report_to``,
  OpenMP waits and the CPU-thread check.

Importing this package imports nothing heavy (the entry stage must answer ``--help`` before torch loads):
``LitTrainerCLI`` and ``main`` load :mod:`lit_trainer.cli.app` on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["LitTrainerCLI", "main"]

if TYPE_CHECKING:
    from lit_trainer.cli.app import LitTrainerCLI, main


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("lit_trainer.cli.app"), name)
    raise AttributeError(f"module 'lit_trainer.cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
