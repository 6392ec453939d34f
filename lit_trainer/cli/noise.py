"""Targeted filters for startup messages of ``lit-trainer`` that the user cannot act on.

Each filter matches one known message and nothing else; other warnings keep their default behaviour.

* Lightning's "💡 Tip: ... try installing [litlogger]" advertisement at every ``Trainer`` creation;
* ``isinstance(treespec, LeafSpec)`` deprecation raised by torch from inside Lightning's own code;
* "Found N module(s) in eval mode at the start of training", only when every module in eval mode holds frozen
  parameters only (a DPO reference model): a module left in eval mode by mistake still warns;
* the progress bars of ``datasets`` (tokenizing, filtering) and ``transformers`` (writing the export) when stderr is
  not a terminal: in a log file each bar is a run of carriage-return updates, and lit_trainer's own plain progress
  lines already say where the run is. On a terminal they stay;
* bitsandbytes' "Failed to load ... from kernels-community" warning (and the ``kernels`` library's own line about the
  same download, e.g. offline). Every run imports bitsandbytes when it is
  installed (the ``qlora`` extra; transformers imports peft, which imports it), and on a CPU with AVX512-BF16 its
  import tries to fetch an optional optimized 4-bit kernel from the Hugging Face hub, which fails offline or for an
  untrusted kernel repository. Harmless: bitsandbytes then uses its own kernels. A run that does not quantize never
  sees it; a run that does is told once, in our words, by :func:`hub_kernel_note`.
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


_HUB_KERNEL_LOGGERS = (
    "bitsandbytes.backends.cpu.ops", "bitsandbytes.backends.mps.ops",
    *(f"kernels._internals.{name}" for name in ("hf_hub", "resolver", "validate", "verify", "digest", "_versions")),
)  # fmt: skip
"""The loggers that report the hub kernel bitsandbytes could not load: its own, and those of the ``kernels`` library
that fetches it (offline: "Skipping publisher trust check for 'kernels-community/...'"). A logger's filters see only
its own records, so each is named; only records naming ``kernels-community`` are dropped."""


class _DropHubKernelFailure(logging.Filter):
    """Drops bitsandbytes' optional hub-kernel failure, remembering that one came (:func:`hub_kernel_note`)."""

    dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "kernels-community" in record.getMessage():
            _DropHubKernelFailure.dropped = True
            return False
        return True


def quiet_hub_kernel_failures() -> None:
    """Install the bitsandbytes hub-kernel filter (idempotent); before bitsandbytes is imported, so before Lightning
    and transformers."""
    for name in _HUB_KERNEL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHubKernelFailure) for f in logger.filters):
            logger.addFilter(_DropHubKernelFailure())


def hub_kernel_note(quantized: bool) -> str | None:
    """What to tell a run about the dropped hub-kernel warning: one line when it quantizes, else nothing."""
    if not (quantized and _DropHubKernelFailure.dropped):
        return None
    return (
        "[lit_trainer] bitsandbytes could not load its optional optimized 4-bit kernel from the Hugging Face hub "
        "(kernels-community: offline, or an untrusted kernel repository); it uses its built-in kernels, which compute "
        "the same results, possibly slower. Nothing to do."
    )


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
