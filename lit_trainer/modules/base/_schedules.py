"""Learning-rate schedules of the default optimizer: transformers' own schedulers, by the HF Trainer's names.

``scheduler`` takes the names of ``TrainingArguments.lr_scheduler_type`` and builds the schedule with
``transformers.get_scheduler``, so the rate of every optimizer step is the HF Trainer's for the same settings
(warmup ``s / warmup`` from 0, decay over ``trainer.estimated_stepping_batches`` steps). ``scheduler_kwargs`` are
the Trainer's ``lr_scheduler_kwargs`` (e.g. ``{"min_lr_rate": 0.1}`` for ``cosine_with_min_lr``,
``{"num_decay_steps": 100}`` for ``warmup_stable_decay``), checked against the scheduler's signature when the module
is built, not when training starts.

Left out: ``reduce_lr_on_plateau`` and ``greedy`` step on a validation metric, not once per optimizer step; pass
them (or any other scheduler) through ``lr_scheduler`` with Lightning's ``monitor`` instead.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Literal, get_args

import torch
from transformers import get_scheduler
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
from transformers.trainer_utils import SchedulerType

SchedulerName = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
]
SCHEDULER_NAMES: tuple[str, ...] = get_args(SchedulerName)
_METRIC_DRIVEN = ("reduce_lr_on_plateau", "greedy")
_SET_BY_MODULE = frozenset({"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"})
_REQUIRED_KWARGS: dict[str, tuple[tuple[str, ...], str]] = {
    "cosine_with_min_lr": (("min_lr", "min_lr_rate"), "{'min_lr_rate': 0.1}"),
    "cosine_warmup_with_min_lr": (("min_lr", "min_lr_rate"), "{'min_lr_rate': 0.1}"),
    "warmup_stable_decay": (("num_decay_steps",), "{'num_decay_steps': 100}"),
}


def _accepted_kwargs(name: str) -> frozenset[str]:
    """The extra keyword arguments ``get_scheduler`` forwards to the scheduler ``name``."""
    if name in ("constant", "constant_with_warmup"):  # get_scheduler passes no extra argument to these
        return frozenset()
    return frozenset(inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters) - _SET_BY_MODULE


def check_schedule(name: str, warmup_steps: float, scheduler_kwargs: dict[str, Any] | None) -> None:
    """Validate the schedule options; every message names the bad value and a fix.

    Raises:
        ValueError: on an unknown or metric-driven scheduler name, a negative warmup, warmup with ``constant``
            (which ignores it, as in transformers), a keyword argument the scheduler does not take, or a missing
            required one.
    """
    if name in _METRIC_DRIVEN:
        raise ValueError(
            f"`scheduler={name!r}` steps on a validation metric, not once per optimizer step: pass it "
            "through `lr_scheduler` with Lightning's `monitor`, or choose one of "
            f"{SCHEDULER_NAMES}."
        )
    if name not in SCHEDULER_NAMES:
        raise ValueError(
            f"`scheduler={name!r}` is invalid: choose one of {SCHEDULER_NAMES} (the names of "
            "transformers' `lr_scheduler_type`)."
        )
    if warmup_steps < 0:
        raise ValueError(f"`warmup_steps={warmup_steps}` is invalid: use steps >= 0 or a fraction in [0, 1).")
    if name == "constant" and warmup_steps:
        raise ValueError(
            f"`scheduler='constant'` has no warmup, so `warmup_steps={warmup_steps}` would be ignored: "
            "use `scheduler='constant_with_warmup'`, or `warmup_steps=0`."
        )
    kwargs = scheduler_kwargs or {}
    unknown = sorted(set(kwargs) - _accepted_kwargs(name))
    if unknown:
        raise ValueError(
            f"`scheduler_kwargs` has {unknown}, which `scheduler={name!r}` does not take: use only "
            f"{sorted(_accepted_kwargs(name)) or 'none'}."
        )
    required, example = _REQUIRED_KWARGS.get(name, ((), ""))
    if required and not any(key in kwargs for key in required):
        raise ValueError(f"`scheduler={name!r}` needs `scheduler_kwargs` with one of {list(required)}, e.g. {example}.")


def resolve_warmup(warmup_steps: float, total_steps: int) -> int:
    """Warmup in optimizer steps, as the HF Trainer: a float below 1 is a fraction of the total (rounded up).

    Example:
        >>> resolve_warmup(0.1, 95), resolve_warmup(50, 95)
        (10, 50)
    """
    return int(warmup_steps) if warmup_steps >= 1 else math.ceil(total_steps * warmup_steps)


def build_schedule(
    optimizer: torch.optim.Optimizer,
    name: str,
    warmup_steps: float,
    total_steps: int,
    scheduler_kwargs: dict[str, Any] | None = None,
) -> torch.optim.lr_scheduler.LRScheduler:
    """``transformers.get_scheduler`` for ``total_steps`` optimizer steps; step it once per optimizer step."""
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=resolve_warmup(warmup_steps, total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=dict(scheduler_kwargs or {}),
    )
