"""Targeted filters for startup messages of ``lit-trainer`` that the user cannot act on.

Each filter matches one known message and nothing else; other warnings keep their default behaviour.

* Lightning's "💡 Tip: ... try installing [litlogger]" advertisement at every ``Trainer`` creation;
* ``isinstance(treespec, LeafSpec)`` deprecation raised by torch from inside Lightning's own code;
* "Found N module(s) in eval mode at the start of training", only when every module in eval mode holds frozen
  parameters only (a DPO reference model): a module left in eval mode by mistake still warns;
* the progress bars of ``datasets`` (tokenizing, filtering) and ``transformers`` (writing the export) when stderr is
  not a terminal: in a log file each bar is a run of carriage-return updates, and lit_trainer's own plain progress
  lines already say where the run is. On a terminal they stay.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TextIO

import torch

_TIP_LOGGER = "lightning.pytorch.utilities.rank_zero"
_EVAL_MODE = r"Found \d+ module\(s\) in eval mode at the start of training"


class _DropLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "[litlogger]" not in str(record.msg)


def quiet_startup_noise() -> None:
    """Install the message filters that do not depend on the model (idempotent)."""
    logger = logging.getLogger(_TIP_LOGGER)
    if not any(isinstance(f, _DropLitLoggerTip) for f in logger.filters):
        logger.addFilter(_DropLitLoggerTip())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def only_frozen_modules_in_eval_mode(model: torch.nn.Module) -> bool:
    """Whether ``model`` has modules in eval mode and none of them holds a trainable parameter.

    Example:
        >>> frozen = torch.nn.Linear(2, 2).requires_grad_(False).eval()
        >>> only_frozen_modules_in_eval_mode(torch.nn.Sequential(torch.nn.Linear(2, 2), frozen))
        True
        >>> only_frozen_modules_in_eval_mode(torch.nn.Sequential(torch.nn.Linear(2, 2).eval()))
        False
    """
    in_eval = [m for m in model.modules() if not m.training]
    return bool(in_eval) and not any(p.requires_grad for m in in_eval for p in m.parameters())


def quiet_frozen_eval_mode_warning(model: torch.nn.Module) -> None:
    """Silence Lightning's eval-mode warning when it is only about frozen modules (a reference model)."""
    if only_frozen_modules_in_eval_mode(model):
        warnings.filterwarnings("ignore", message=_EVAL_MODE)


def quiet_progress_bars_off_terminal(stream: TextIO | None = None) -> bool:
    """Turn off the ``datasets`` and ``transformers`` progress bars when ``stream`` (stderr) is not a terminal.

    Returns:
        Whether they were turned off.
    """
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        return False
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    return True
