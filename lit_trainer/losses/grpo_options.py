"""The keyword options of the GRPO policy loss and of its metrics: their one definition, defaults and validation.

:func:`~lit_trainer.losses.grpo.grpo_policy_loss` and :func:`~lit_trainer.losses.grpo.grpo_loss_metrics` both take
``**options`` typed by :class:`GRPOLossOptions`; :func:`resolve_loss_options` fills in :data:`GRPO_LOSS_DEFAULTS`
and refuses unknown keys, :func:`check_loss_inputs` validates the values against the tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from torch import Tensor

from lit_trainer.losses.grpo_advantages import _check_choice

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]


class GRPOLossOptions(TypedDict, total=False):
    """Keyword options of ``grpo_policy_loss`` and ``grpo_loss_metrics`` (described in ``grpo_policy_loss``'s Args).

    Every key is optional; :data:`GRPO_LOSS_DEFAULTS` holds the default of each.
    """

    loss_type: LossType
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    beta: float
    ref_logps: Tensor | None
    use_bias_correction_kl: bool
    importance_sampling_level: ImportanceSamplingLevel
    max_completion_length: int | None
    num_items_in_batch: Tensor | float | int | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    policy_mask: Tensor | None
    importance_sampling_ratio: Tensor | None


GRPO_LOSS_DEFAULTS: GRPOLossOptions = {
    "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None, "delta": None, "beta": 0.0, "ref_logps": None,
    "use_bias_correction_kl": True, "importance_sampling_level": "token", "max_completion_length": None,
    "num_items_in_batch": None, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "policy_mask": None,
    "importance_sampling_ratio": None,
}  # fmt: skip
"""The default of every :class:`GRPOLossOptions` key (the reference's defaults; ``GRPOModule`` uses the same)."""


def resolve_loss_options(function: str, options: Mapping[str, Any]) -> GRPOLossOptions:
    """All the options: ``options`` over :data:`GRPO_LOSS_DEFAULTS`, ``epsilon_high`` None replaced by ``epsilon``.

    Raises:
        TypeError: on a key that is not a :class:`GRPOLossOptions` key (named, with the valid ones).
    """
    unknown = sorted(set(options) - set(GRPO_LOSS_DEFAULTS))
    if unknown:
        raise TypeError(
            f"{function}() got unknown option(s) {', '.join(unknown)}: the options are {', '.join(GRPO_LOSS_DEFAULTS)}."
        )
    resolved: GRPOLossOptions = {**GRPO_LOSS_DEFAULTS, **options}  # type: ignore[typeddict-item]
    if resolved["epsilon_high"] is None:
        resolved["epsilon_high"] = resolved["epsilon"]
    return resolved


def vespo_shape(c: GRPOLossOptions) -> tuple[float, float, float, float]:
    """``(k_pos, lambda_pos, k_neg, lambda_neg)`` of the VESPO gamma weight."""
    return c["vespo_k_pos"], c["vespo_lambda_pos"], c["vespo_k_neg"], c["vespo_lambda_neg"]


def check_loss_inputs(c: GRPOLossOptions, logps: Tensor, old: Tensor | None, adv: Tensor, mask: Tensor) -> None:
    """Validate resolved options against the tensors; every message names the bad value and the fix.

    Raises:
        ValueError: on an unknown choice, a shape mismatch, ``beta != 0`` without ``ref_logps``, dr_grpo without
            ``max_completion_length``, a negative epsilon or beta, ``delta <= 1``, a non-positive SAPO temperature,
            vespo with sequence-level importance sampling or with a ``(B, 1)`` ``importance_sampling_ratio``.
    """
    _check_choice("loss_type", c["loss_type"], LossType)
    _check_choice("importance_sampling_level", c["importance_sampling_level"], ImportanceSamplingLevel)
    if logps.dim() != 2 or mask.shape != logps.shape:
        raise ValueError(f"`logps` {tuple(logps.shape)} and `mask` {tuple(mask.shape)} must both be (B, T).")
    ref, beta, delta, mcl = c["ref_logps"], c["beta"], c["delta"], c["max_completion_length"]
    for name, other in (("old_logps", old), ("ref_logps", ref)):
        if other is not None and other.shape != logps.shape:
            raise ValueError(f"`{name}` has shape {tuple(other.shape)}, expected {tuple(logps.shape)} like `logps`.")
    policy_mask = c["policy_mask"]
    if policy_mask is not None and policy_mask.shape not in (logps.shape, (logps.shape[0], 1)):
        raise ValueError(
            f"`policy_mask` has shape {tuple(policy_mask.shape)}: give (B, T) = {tuple(logps.shape)} or (B, 1)."
        )
    is_ratio = c["importance_sampling_ratio"]
    if is_ratio is not None and is_ratio.shape not in (logps.shape, (logps.shape[0], 1)):
        raise ValueError(
            f"`importance_sampling_ratio` has shape {tuple(is_ratio.shape)}: give (B, T) = {tuple(logps.shape)} "
            "(a token_* mode) or (B, 1) (a sequence_* mode)."
        )
    if is_ratio is not None and c["loss_type"] == "vespo" and is_ratio.shape != logps.shape:
        raise ValueError(
            f"`loss_type='vespo'` needs a per-token `importance_sampling_ratio` of shape {tuple(logps.shape)}, got "
            f"{tuple(is_ratio.shape)}: use rollout_importance_sampling_mode='token_truncate' or 'token_mask' "
            "(VESPO folds the log of each token's ratio into its sequence weight)."
        )
    if adv.numel() != logps.shape[0]:
        raise ValueError(f"`advantages` has {adv.numel()} values for {logps.shape[0]} rows: give one per row.")
    if c["epsilon"] < 0 or c["epsilon_high"] < 0:
        raise ValueError(
            f"`epsilon={c['epsilon']}`, `epsilon_high={c['epsilon_high']}` are invalid: both must be >= 0."
        )
    if delta is not None and delta <= 1.0:
        raise ValueError(f"`delta={delta}` is invalid: it must be > 1 (recommended > 1 + epsilon_high), or None.")
    if beta < 0:
        raise ValueError(f"`beta={beta}` is invalid: the KL coefficient must be >= 0.")
    if beta != 0 and ref is None:
        raise ValueError(f"`beta={beta}` needs `ref_logps` (reference-model log-probs): pass them or set beta=0.")
    if c["loss_type"] == "dr_grpo" and (mcl is None or mcl < 1):
        raise ValueError(
            f"`loss_type='dr_grpo'` needs `max_completion_length` >= 1 (got {mcl}): pass the "
            "generation's max_completion_length."
        )
    if c["loss_type"] == "vespo" and c["importance_sampling_level"] != "token":
        raise ValueError(
            f"`importance_sampling_level={c['importance_sampling_level']!r}` does not apply to "
            "`loss_type='vespo'`, which weights each sequence by its own summed log-ratio: use "
            "importance_sampling_level='token'."
        )
    if c["loss_type"] == "sapo" and (c["sapo_temperature_pos"] <= 0 or c["sapo_temperature_neg"] <= 0):
        raise ValueError(
            f"`sapo_temperature_pos={c['sapo_temperature_pos']}`, `sapo_temperature_neg="
            f"{c['sapo_temperature_neg']}` are invalid: both must be > 0."
        )
