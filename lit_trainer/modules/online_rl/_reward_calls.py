"""Calling GRPO reward functions from a LightningModule with the keywords TRL 1.16 passes them.

Besides ``prompts``, ``completions``, ``completion_ids`` and the dataset columns, TRL calls every reward function
with ``trainer_state``, ``log_metric(name, value)`` and ``log_extra(column, values)``; a TRL reward function that
takes them runs here unchanged. An environment round (``environment_factory``) also passes ``environments``, the
rollouts' environment instances in row order, to the functions that take it.

* ``trainer_state``: a ``transformers.TrainerState`` filled from the Lightning trainer: ``global_step`` (optimizer
  steps done), ``epoch`` (a float, ``epoch + (batch + 1) / batches`` as the HF Trainer), ``max_steps``,
  ``num_train_epochs``, ``logging_steps``, ``train_batch_size``, ``is_world_process_zero`` and
  ``is_local_process_zero``. It is a fresh copy per call: changing it changes nothing.
* ``log_metric(name, value)``: the values of one scoring are averaged, then over ranks (as TRL); in training the
  metric is logged under ``name`` like ``reward`` (averaged over the logging window's micro-steps), in validation as
  ``val_<name>``.
* ``log_extra(column, values)``: per-completion values (TRL shows them in its completions table). Lightning loggers
  take scalars, so a numeric column is logged as its mean ``extra/<column>``; every column of the last scoring is kept,
  this rank's rows, in ``module.reward_extra`` (``{column: values}``).

Under DDP the metric names of all ranks are merged (one small object all-gather per scoring), so a function that logs
a metric on some ranks only never desynchronises the collectives.

``reward_funcs`` entries are resolved here too (:func:`resolve_reward_funcs`): functions and their import paths, and
reward models (a directory, preset or hub id, or a model object), which become
:class:`~lit_trainer.rewards.RewardModelScorer` callables scored on every rank's own rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerState

from lit_trainer.core.import_path import import_object
from lit_trainer.data.prompt import PROMPTS, REWARD_COLUMNS
from lit_trainer.models import is_preset
from lit_trainer.rewards import RewardModelInputs, RewardModelScorer, call_reward_functions, reward_function_name

RewardSpec = str | Callable[..., Any]
"""A ``reward_funcs`` entry: a callable (a function, a ``PreTrainedModel``), an import path, or a model path."""


def as_list(items: Any) -> list[Any]:
    """A single entry (a string, callable or None) as a one-item list; a sequence as a list."""
    return [items] if items is None or isinstance(items, str) or callable(items) else list(items)


def is_model_path(spec: str) -> bool:
    """A reward-model source rather than an import path: an existing directory, a preset, or a hub id with a '/'."""
    return os.path.isdir(os.path.expanduser(spec)) or is_preset(spec) or "/" in spec


def resolve_reward_funcs(
    funcs: Sequence[RewardSpec] | RewardSpec,
    processing_classes: Sequence[Any] | Any = None,
    *,
    batch_size: int | None = None,
    trust_remote_code: bool = False,
    reward_model_inputs: RewardModelInputs = "as_trained",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[Callable[..., Any]]:
    """Reward callables from TRL-style ``reward_funcs`` and ``reward_processing_classes``.

    A function (or ``'package.module.function'``) is used as is. A reward model (a ``torch.nn.Module``, or a string
    that :func:`is_model_path`) becomes a :class:`~lit_trainer.rewards.RewardModelScorer` with the matching
    ``processing_classes`` entry as tokenizer (None = the model's own), ``batch_size``, ``reward_model_inputs`` (its
    ``inputs``) and ``chat_template_kwargs``. Only what the user's config or code names is imported or loaded
    (docs/design.md#nothing-unasked).

    Raises:
        ValueError: on an empty list, a path that does not import, an object that is not callable, a
            ``processing_classes`` list of another length, or a tokenizer given for a function.
    """
    items = as_list(funcs)
    if not items:
        raise ValueError(
            "`reward_funcs` is empty: give at least one reward function, e.g. "
            "['lit_trainer.rewards.arithmetic_reward']."
        )
    tokenizers = [None] * len(items) if processing_classes is None else as_list(processing_classes)
    if len(tokenizers) != len(items):
        raise ValueError(
            f"`reward_processing_classes` has {len(tokenizers)} entries for {len(items)} reward functions: give one "
            "per entry of `reward_funcs` (None for functions and for models that use their own tokenizer)."
        )
    resolved = []
    for item, tokenizer in zip(items, tokenizers, strict=True):
        if isinstance(item, str) and not is_model_path(item):
            item = import_object(
                item,
                "Reward function",
                "give 'package.module.function' of an importable function, or for a reward model an existing "
                "directory, a preset or a hub id 'org/name'.",
            )
        if isinstance(item, (str, torch.nn.Module)):
            item = RewardModelScorer(
                item, tokenizer, batch_size=batch_size, trust_remote_code=trust_remote_code,
                inputs=reward_model_inputs, chat_template_kwargs=chat_template_kwargs,
            )  # fmt: skip
        elif tokenizer is not None and not isinstance(item, RewardModelScorer):
            raise ValueError(
                f"`reward_processing_classes` gives a tokenizer for reward function {item!r}: tokenizers are for "
                "reward models only; put None at that position."
            )
        if not callable(item):
            raise ValueError(f"Reward function {item!r} is not callable: give a function or its import path.")
        resolved.append(item)
    return resolved


def spec_name(spec: Any) -> str:
    """What the hyperparameters record for a ``reward_funcs`` entry: a string as given, else the display name
    (for a model its ``config._name_or_path``)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, torch.nn.Module):
        return getattr(getattr(spec, "config", None), "_name_or_path", "") or type(spec).__name__
    return reward_function_name(spec)


def trainer_state(trainer: Any) -> TrainerState:
    """The ``transformers.TrainerState`` a TRL reward function would get at this point of a Lightning fit."""
    batches = trainer.num_training_batches
    finite = isinstance(batches, int) and batches > 0
    batch_idx = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "batch_idx", -1)
    fitting = trainer.state.fn == "fit"  # outside fit, the estimate would load the training data
    total = trainer.estimated_stepping_batches if fitting and trainer.max_steps <= 0 else trainer.max_steps
    max_steps = int(total) if 0 < total < math.inf else 0
    epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else 0
    if not epochs and finite and max_steps:  # as HF with max_steps: ceil(max_steps / optimizer steps per epoch)
        epochs = math.ceil(max_steps / math.ceil(batches / trainer.accumulate_grad_batches))
    datamodule = getattr(trainer, "datamodule", None)
    return TrainerState(
        epoch=trainer.current_epoch + ((batch_idx + 1) / batches if finite else 0.0),
        global_step=trainer.global_step, max_steps=max_steps, num_train_epochs=epochs,
        logging_steps=trainer.log_every_n_steps, train_batch_size=getattr(datamodule, "batch_size", None),
        is_local_process_zero=trainer.local_rank == 0, is_world_process_zero=trainer.is_global_zero,
    )  # fmt: skip


class RewardLog:
    """Collects what the reward functions of one scoring log through ``log_metric`` and ``log_extra``."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: one scalar under ``name``."""
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        """TRL's ``log_extra``: per-completion values of ``column``."""
        self.extra.setdefault(column, []).extend(values)

    def scalars(self) -> dict[str, list[float]]:
        """The logged metrics plus, as ``extra/<column>``, every column whose values are all numbers."""
        out = dict(self.metrics)
        for column, values in self.extra.items():
            if values and all(isinstance(v, Real) and not isinstance(v, bool) for v in values):
                out[f"extra/{column}"] = [float(v) for v in values]
        return out


def mean_over_ranks(values: dict[str, list[float]], trainer: Any, device: torch.device) -> dict[str, Tensor]:
    """Mean of each name's values over all ranks (names merged over ranks), as 0-dim tensors equal on every rank."""
    names = sorted(values)
    if trainer.world_size > 1:
        gathered: list[list[str] | None] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, names)
        names = sorted({name for rank_names in gathered for name in rank_names or []})
    if not names:
        return {}
    sums = torch.tensor([[math.fsum(values.get(n, [])), len(values.get(n, []))] for n in names], device=device)
    if trainer.world_size > 1:
        sums = trainer.strategy.reduce(sums, reduce_op="sum")
    means = sums[:, 0] / sums[:, 1].clamp(min=1.0)
    return {name: means[i] for i, name in enumerate(names)}


def score_completions(
    module: Any, batch: dict[str, Any], completions: list, completion_ids: list, extra: dict[str, Any] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Call ``module.reward_funcs`` on this rank's rows with TRL's keywords (plus ``extra``: ``environments`` of an
    environment round, the extra fields of a ``rollout_func``; each function gets those it names or ``**kwargs``).

    Returns:
        ``(rewards, logged)``: the ``(N, F)`` reward matrix of :func:`~lit_trainer.rewards.call_reward_functions` and
        the logged scalars averaged over ranks; sets ``module.reward_extra`` to the ``log_extra`` columns.
    """
    for func in module.reward_funcs:
        if isinstance(func, RewardModelScorer):
            func.to(module.device)
    log = RewardLog()
    keywords = {
        "trainer_state": trainer_state(module.trainer),
        "log_metric": log.log_metric,
        "log_extra": log.log_extra,
        **(extra or {}),
    }
    rewards = call_reward_functions(
        module.reward_funcs, batch[PROMPTS], completions, completion_ids, batch[REWARD_COLUMNS], extra_kwargs=keywords
    )
    module.reward_extra = log.extra
    return rewards, mean_over_ranks(log.scalars(), module.trainer, module.device)
