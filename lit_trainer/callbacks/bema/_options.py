"""BEMA's argument checks: each option's valid range, and the settings that identify an average."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

# the settings that define the average: they key the checkpoint state (two BEMA callbacks with other settings coexist)
HPARAMS = ("update_freq", "ema_power", "bias_power", "lag", "update_after", "multiplier", "min_ema_multiplier")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_RULES = {
    "update_freq": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "ema_power": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "bias_power": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "lag": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "update_after": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "multiplier": (lambda v: _is_real(v) and v > 0, "a finite number > 0 (so that lag + multiplier*t > 0)"),
    "min_ema_multiplier": (lambda v: _is_real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "ref_model_update_freq": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "ref_model_update_after": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    **{
        flag: (lambda v: isinstance(v, bool), "True or False")
        for flag in ("update_ref_model", "evaluate_with_bema", "apply_at_end", "export_hf")
    },
    "export_dir": (lambda v: v is None or (isinstance(v, (str, os.PathLike)) and str(v) != ""), "None or a path"),
}


def check_bema_args(args: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first ``BEMA(...)`` argument out of range and its valid range."""
    for name, (ok, need) in _RULES.items():
        if not ok(args[name]):
            raise ValueError(f"`BEMA({name}={args[name]!r})` is invalid: {name} must be {need}.")


def check_device(device: Any) -> torch.device | None:
    """``BEMA(device=...)`` as a ``torch.device`` (``None`` stays ``None``: each buffer next to its parameter)."""
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"`BEMA(device={device!r})` is invalid: use a torch device such as 'cpu' or 'cuda', "
            "or None to keep each buffer next to its parameter."
        ) from err
