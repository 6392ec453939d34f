"""Validation of the online-RL options (:class:`~lit_trainer.modules.online_rl.OnlineRLModule`'s and its subclasses'):
ranges and choices, each error naming the value and a valid setting."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

from lit_trainer.losses.grpo_advantages import Aggregation, ScaleRewards
from lit_trainer.losses.grpo_masks import SamplingISMode
from lit_trainer.losses.grpo_options import ImportanceSamplingLevel, LossType
from lit_trainer.rewards import RewardModelInputs

_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_generations": (lambda v: v >= 2, "the advantages compare the completions of a prompt: use >= 2, e.g. 8"),
    "num_iterations": (lambda v: v >= 1, "use >= 1"),
    "steps_per_generation": (lambda v: v is None or v >= 1, "use >= 1, or None"),
    "generation_batch_size": (lambda v: v is None or v >= 1, "use >= 1, or None"),
    "max_completion_length": (lambda v: v >= 1, "use >= 1 new tokens"),
    "reward_model_batch_size": (lambda v: v is None or v >= 1, "use >= 1 rows, or None for one pass per scoring"),
    "max_tool_calling_iterations": (lambda v: v is None or v >= 0, "use >= 0 tool rounds, or None for no limit"),
    "temperature": (lambda v: v > 0, "it must be > 0 (e.g. 0.7 or 1.0)"),
    "top_p": (lambda v: 0 < v <= 1, "it must be in (0, 1]; 1.0 disables it"),
    "top_k": (lambda v: v >= 0, "it must be >= 0; 0 disables it"),
    "min_p": (lambda v: v is None or 0 <= v <= 1, "it must be in [0, 1], or None"),
    "repetition_penalty": (lambda v: v > 0, "it must be > 0; 1.0 disables it"),
    "epsilon": (lambda v: v >= 0, "it must be >= 0"),
    "epsilon_high": (lambda v: v is None or v >= 0, "it must be >= 0, or None (= epsilon)"),
    "delta": (lambda v: v is None or v > 1, "it must be > 1 (e.g. 1 + epsilon_high + 1), or None"),
    "beta": (lambda v: v >= 0, "it must be >= 0; 0 disables the KL term and the reference model"),
    "sapo_temperature_pos": (lambda v: v > 0, "it must be > 0"),
    "sapo_temperature_neg": (lambda v: v > 0, "it must be > 0"),
    "vespo_lambda_pos": (lambda v: v >= 0, "it must be >= 0 (reference default 3.0)"),
    "vespo_lambda_neg": (lambda v: v >= 0, "it must be >= 0 (reference default 2.0)"),
    "top_entropy_quantile": (lambda v: 0 <= v <= 1, "it must be in [0, 1]; 1.0 trains on every token, 0.2 is usual"),
    "entropy_coef": (math.isfinite, "it must be a finite number; 0.0 disables the entropy bonus"),
    "entropy_coef_min": (lambda v: v >= 0, "it must be >= 0 (reference default 0.0)"),
    "entropy_coef_max": (lambda v: v >= 0, "it must be >= 0 (reference default 1.0)"),
    "entropy_coef_delta": (lambda v: v >= 0, "it must be >= 0 (reference default 0.005)"),
    "entropy_target": (lambda v: v >= 0, "it must be >= 0 nats (e.g. the entropy logged early in training)"),
    "off_policy_mask_threshold": (
        lambda v: v is None or math.isfinite(v),
        "it must be a finite number (e.g. 0.5), or None to disable the mask",
    ),
    "num_completions_to_print": (lambda v: v is None or v >= 1, "use >= 1, or None to print every completion"),
    "max_staleness": (
        lambda v: v is None or (isinstance(v, int) and v >= 0),
        "use an int >= 0 (rounds the sampling weights may lag; 1 overlaps generation with training), or None for "
        "synchronous rollouts",
    ),
    "rollout_worker_threads": (lambda v: v is None or v >= 1, "use >= 1 CPU threads, or None (the trainer's count)"),
    "rollout_importance_sampling_clip_max": (lambda v: v is None or v > 0, "it must be > 0 (e.g. 3.0), or None"),
    "rollout_importance_sampling_clip_min": (lambda v: v is None or v >= 0, "it must be >= 0, or None"),
    "sampler_check_threshold": (
        lambda v: v is None or v > 0,
        "it must be > 0 (a mean |delta log p| per token, e.g. 0.05), or None to skip the check",
    ),
}
_CHOICES = {
    "loss_type": LossType,
    "importance_sampling_level": ImportanceSamplingLevel,
    "scale_rewards": ScaleRewards,
    "multi_objective_aggregation": Aggregation,
    "reward_model_inputs": RewardModelInputs,
    "rollout_importance_sampling_mode": SamplingISMode,
}
CacheImplementation = Literal[
    "static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid",
    "offloaded_hybrid_chunked", "dynamic", "offloaded", "quantized",
]  # fmt: skip
"""transformers' KV-cache implementations (``GenerationConfig.cache_implementation``)."""


def check_options(options: dict[str, Any], owner: str) -> None:
    """Validate the options given (any subset of an online-RL module's arguments; the others are not looked at); every
    message names the value and a valid setting.

    Args:
        options: option values by name; names without a rule here are ignored.
        owner: the class the user constructed, named in the messages (``GRPOModule``, ``RLOOModule``).

    Raises:
        ValueError: on an out-of-range value, an unknown choice, or two options that do not go together (e.g. both
            ``steps_per_generation`` and ``generation_batch_size``).
    """
    for name, (valid, fix) in _RANGES.items():
        if name in options and not valid(options[name]):
            raise ValueError(f"`{owner}({name}={options[name]!r})` is invalid: {fix}.")
    for name, literal in _CHOICES.items():
        if name in options and options[name] not in get_args(literal):
            raise ValueError(f"`{owner}({name}={options[name]!r})` is invalid: choose one of {get_args(literal)}.")
    if options.get("loss_type") == "vespo" and options.get("importance_sampling_level", "token") != "token":
        raise ValueError(
            f"`{owner}(loss_type='vespo')` weights each sequence by its own summed log-ratio: "
            "`importance_sampling_level` must be 'token'."
        )
    if {"cache_implementation", "sync_ref_model", "beta", "use_transformers_continuous_batching"} <= options.keys():
        _check_shared_pairs(options, owner)
    if {"entropy_coef_min", "max_staleness", "rollout_importance_sampling_mode", "loss_type"} <= options.keys():
        _check_grpo_pairs(options, owner)
    if options.get("steps_per_generation") is not None and options.get("generation_batch_size") is not None:
        raise ValueError(
            "`steps_per_generation` and `generation_batch_size` are mutually exclusive: set only one "
            "(generation_batch_size = batch_size x world_size x steps_per_generation)."
        )


def _check_shared_pairs(options: dict[str, Any], owner: str) -> None:
    """Options of every online-RL module that only make sense together (TRL 1.16's conditions, with the fix)."""
    cache = options["cache_implementation"]
    if cache is not None and cache not in get_args(CacheImplementation):
        raise ValueError(
            f"`{owner}(cache_implementation={cache!r})` is invalid: choose one of {get_args(CacheImplementation)}, "
            "or None for the model's default cache."
        )
    if options["sync_ref_model"] and options["beta"] == 0:
        raise ValueError(
            f"`{owner}(sync_ref_model=True)` with beta=0.0 is invalid: without the KL term there is no reference "
            "model to synchronise. Set beta > 0 (e.g. 0.04), or sync_ref_model=False."
        )
    continuous = options["use_transformers_continuous_batching"] or options["use_transformers_paged"]
    if continuous and cache is not None:
        raise ValueError(
            f"`{owner}(cache_implementation={cache!r})` applies to `generate`, but continuous batching uses its "
            "own paged cache: set cache_implementation=None, or use_transformers_continuous_batching=False."
        )


def _check_grpo_pairs(options: dict[str, Any], owner: str) -> None:
    """GRPOModule's options that only make sense together (TRL 1.16's conditions, with the fix in the message)."""
    if options["entropy_coef_min"] > options["entropy_coef_max"]:
        raise ValueError(
            f"`{owner}(entropy_coef_min={options['entropy_coef_min']}, entropy_coef_max="
            f"{options['entropy_coef_max']})` is invalid: the minimum must not exceed the maximum."
        )
    low, high = options["rollout_importance_sampling_clip_min"], options["rollout_importance_sampling_clip_max"]
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"`{owner}(rollout_importance_sampling_clip_min={low}, rollout_importance_sampling_clip_max={high})` "
            "is invalid: the minimum must be below the maximum."
        )
    mode = options["rollout_importance_sampling_mode"]
    if options["rollout_importance_sampling_correction"] and mode.endswith("truncate") and low is None and high is None:
        raise ValueError(
            f"`{owner}(rollout_importance_sampling_mode={mode!r})` clips the ratio, but both bounds are None: set "
            "rollout_importance_sampling_clip_max (e.g. 3.0) or rollout_importance_sampling_clip_min."
        )
