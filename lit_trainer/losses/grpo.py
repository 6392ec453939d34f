"""GRPO policy loss of every supported type and its metrics (TRL's GRPOTrainer, docs/design.md#trl-grpo).

Pure tensor functions (torch only). Numerics follow TRL 1.16 ``GRPOTrainer`` with one deliberate fix: the KL bias
correction always uses the per-token ratio (TRL issue #6586 / PR #7188), so sequence-level importance sampling no
longer adds a spurious gradient term to the KL. The advantages live in :mod:`lit_trainer.losses.grpo_advantages`
and are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from typing_extensions import Unpack

from lit_trainer.losses.grpo_options import (
    GRPO_LOSS_DEFAULTS,
    GRPOLossOptions,
    ImportanceSamplingLevel,
    LossType,
    check_loss_inputs,
    resolve_loss_options,
    vespo_shape,
)

__all__ = [
    "CLIPPED_LOSS_TYPES", "GRPO_LOSS_DEFAULTS", "GRPOLossOptions", "ImportanceSamplingLevel", "LossType",
    "grpo_loss_metrics", "grpo_policy_loss", "k3_kl", "vespo_weights",
]  # fmt: skip

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""Loss types using the PPO-style two-sided clipped surrogate (and reporting ``clip_ratio/*`` metrics)."""


# ------------------------------------------------------------------------------------------------- policy loss
def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` broadcast to the mask's shape, exactly 0 where the mask is 0 even if ``x`` is inf/NaN there."""
    x = x.expand_as(mask)
    return torch.where(mask > 0, x * mask, torch.zeros_like(x))


def _sequence_log_weight(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO: masked mean of the token log-ratios per row, shape (B, 1)."""
    return (_masked(log_ratio, mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


_IS_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": lambda log_ratio, mask: log_ratio,
    "sequence": _sequence_log_weight,
}


def _clipped_token_loss(ratio: Tensor, adv: Tensor, logps: Tensor, c: GRPOLossOptions) -> Tensor:
    """``-min(r A, clamp(r, 1-eps_lo, 1+eps_hi) A)``, the unclipped ``r`` capped at ``delta`` if set."""
    clipped = torch.clamp(ratio, 1.0 - c["epsilon"], 1.0 + c["epsilon_high"])
    if c["delta"] is not None:
        ratio = torch.clamp(ratio, max=c["delta"])
    return -torch.min(ratio * adv, clipped * adv)


def _cispo_token_loss(ratio: Tensor, adv: Tensor, logps: Tensor, c: GRPOLossOptions) -> Tensor:
    """``-sg(min(r, eps_hi)) A logp`` (the cap is eps_high itself, not 1 + eps_high, as in the reference)."""
    return -torch.clamp(ratio, max=c["epsilon_high"]).detach() * adv * logps


def _sapo_token_loss(ratio: Tensor, adv: Tensor, logps: Tensor, c: GRPOLossOptions) -> Tensor:
    """``-(4/tau) sigmoid(tau (r - 1)) A`` with ``tau`` = the positive temperature if A > 0, else the negative."""
    tau = torch.where(adv > 0, c["sapo_temperature_pos"], c["sapo_temperature_neg"]).to(ratio.dtype)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv


@torch.no_grad()
def vespo_weights(
    log_ratio: Tensor,
    mask: Tensor,
    advantages: Tensor,
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    importance_sampling_ratio: Tensor | None = None,
) -> Tensor:
    """VESPO's gamma weight per sequence, ``(B, 1)``, without gradient.

    With ``s = sum_t m clamp(lr, -20, 20)`` and ``log w = clamp(s, ln 1e-8, 20)``:
    ``log phi = lambda + k log w - lambda w``, i.e. ``phi = w^k e^(lambda (1 - w))`` (so ``phi(1) = 1``), with
    ``(k, lambda) = (k_pos, lambda_pos)`` if A >= 0 else ``(k_neg, lambda_neg)`` (``lambda`` at least 1e-4, as the
    reference); non-finite values become 0.

    A per-token sampler correction ``rho`` (``importance_sampling_ratio``, ``(B, T)``, see
    :func:`~lit_trainer.losses.grpo_masks.sampling_importance_ratio`) adds ``sum_t m clamp(ln rho, ln 1e-8, 20)`` to
    ``s`` before the final clamp: ``w`` becomes the sequence ratio of the current policy to the SAMPLER. A token the
    correction masked (``rho = 0``) contributes ``ln 1e-8`` and so all but zeroes its sequence's weight. The sum is
    masked (the reference sums over every position; the same wherever padding has ``rho = 1``, which
    ``sampling_importance_ratio`` gives it unless the clip bounds exclude 1).

    Example:
        >>> vespo_weights(torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), torch.tensor([1.0]))  # on-policy: w = 1
        tensor([[1.]])
    """
    k_pos, lambda_pos, k_neg, lambda_neg = vespo
    log_w = _masked(log_ratio.clamp(-20.0, 20.0), mask).sum(-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_rho = torch.log(importance_sampling_ratio.to(log_w.dtype)).clamp(math.log(1e-8), 20.0)
        log_w = log_w + _masked(log_rho, mask).sum(-1, keepdim=True)
    log_w = log_w.clamp(math.log(1e-8), 20.0)
    positive = advantages.reshape(-1, 1) >= 0
    k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(positive, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)  # as the reference
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


_TOKEN_LOSSES: dict[str, Callable[[Tensor, Tensor, Tensor, GRPOLossOptions], Tensor]] = {
    **dict.fromkeys(CLIPPED_LOSS_TYPES, _clipped_token_loss),
    "cispo": _cispo_token_loss,
    "sapo": _sapo_token_loss,
}


def _row_sums(loss: Tensor, mask: Tensor) -> Tensor:
    """``sum_t m L`` per row."""
    return _masked(loss, mask).sum(-1)


def _agg_sequence_mean(loss: Tensor, mask: Tensor, c: GRPOLossOptions) -> Tensor:
    return (_row_sums(loss, mask) / mask.sum(-1).clamp(min=1.0)).mean()


def _agg_token_mean(loss: Tensor, mask: Tensor, c: GRPOLossOptions) -> Tensor:
    return _row_sums(loss, mask).sum() / mask.sum().clamp(min=1.0)


def _agg_num_items(loss: Tensor, mask: Tensor, c: GRPOLossOptions) -> Tensor:
    if c["num_items_in_batch"] is None:
        return _agg_token_mean(loss, mask, c)
    denom = torch.as_tensor(c["num_items_in_batch"], dtype=loss.dtype, device=loss.device).clamp(min=1.0)
    return _row_sums(loss, mask).sum() / denom


_AGGREGATORS: dict[str, Callable[[Tensor, Tensor, GRPOLossOptions], Tensor]] = {
    "grpo": _agg_sequence_mean,
    "sapo": _agg_sequence_mean,
    "bnpo": _agg_token_mean,
    "dr_grpo": lambda loss, mask, c: _row_sums(loss, mask).sum() / (loss.shape[0] * c["max_completion_length"]),
    "dapo": _agg_num_items,
    "cispo": _agg_num_items,
    "vespo": _agg_num_items,
    "luspo": lambda loss, mask, c: _row_sums(loss, mask).mean(),
}


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator per token: ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    diff = ref_logps - logps
    return torch.exp(diff) - diff - 1.0


def _kl_term(logps: Tensor, ref_logps: Tensor, log_ratio: Tensor, c: GRPOLossOptions) -> Tensor:
    """k3, times the PER-TOKEN ratio when bias-corrected (fix of TRL #6586: never the (B, 1) sequence ratio)."""
    kl = k3_kl(logps, ref_logps)
    return kl * torch.exp(log_ratio) if c["use_bias_correction_kl"] else kl


def grpo_policy_loss(
    logps: Tensor, old_logps: Tensor | None, advantages: Tensor, mask: Tensor, **options: Unpack[GRPOLossOptions]
) -> Tensor:
    """GRPO policy loss of ONE micro-batch, without any gradient-accumulation or world-size factor.

    With ``lr = logps - old`` the ratio is ``r = exp(lr)`` per token ("token") or ``r = exp(masked_mean_t lr)`` per
    row ("sequence", GSPO). Per-token loss ``L``:

    * grpo, bnpo, dr_grpo, dapo, luspo: ``-min(r' A, clamp(r, 1-eps, 1+eps_high) A)`` with ``r' = min(r, delta)``
      when ``delta`` is set (two-sided cap of the unclipped branch), else ``r' = r``;
    * cispo: ``-sg(min(r, eps_high)) A logp`` (cap at ``eps_high`` itself; the reference docs suggest 5.0);
    * sapo: ``-(4/tau) sigmoid(tau (r - 1)) A``, ``tau = sapo_temperature_pos`` if A > 0 else ``..._neg``;
    * vespo: ``-phi A logp`` with ``phi`` the no-grad gamma weight of the sequence ratio (:func:`vespo_weights`);
      token-level only, no clipping (``epsilon``/``delta`` unused).

    ``policy_mask`` (0/1, ``(B, T)`` or ``(B, 1)``) multiplies this policy term (TRL's ``top_entropy_quantile`` and
    ``off_policy_mask_threshold`` masks, :mod:`lit_trainer.losses.grpo_masks`); the normalisers below still count
    every token of ``mask``.

    ``importance_sampling_ratio`` ``rho`` (``(B, T)`` or ``(B, 1)``, no gradient) corrects for rows generated by a
    different (stale or differently computed) sampler: ``rho = pi_old / pi_sampler``, truncated or masked by
    :func:`~lit_trainer.losses.grpo_masks.sampling_importance_ratio` (TRL's ``vllm_importance_sampling_*``). For every
    type but vespo it multiplies the policy term after ``policy_mask`` (``L <- L * rho``), before the KL is added;
    for vespo, which needs a ``(B, T)`` ratio, ``sum_t m clamp(ln rho, ln 1e-8, 20)`` is added to the log of the
    gamma weight's sequence ratio (:func:`vespo_weights`). None (the default) leaves the loss exactly unchanged.

    If ``beta != 0``: ``L += beta * k3`` with ``k3 = exp(ref - logp) - (ref - logp) - 1``, multiplied by the
    PER-TOKEN ratio ``exp(lr)`` when ``use_bias_correction_kl`` (not detached). Deliberate fix of the reference:
    TRL 1.16 multiplies by the (B, 1) sequence ratio under ``importance_sampling_level="sequence"``, which adds a
    spurious gradient term (TRL #6586 / PR #7188); with "token" both agree.

    What the masked sum of ``L`` (m = mask, B rows) is divided by; equal to the reference with GA_cur = 1, P = 1:

    * grpo, sapo: per-row token mean, then mean over all B rows (empty rows count as 0);
    * bnpo: ``max(1, sum m)`` of this micro-batch;
    * dr_grpo: ``B * max_completion_length``;
    * dapo, cispo, vespo: ``max(1, num_items_in_batch)``, or the local ``max(1, sum m)`` when it is None. The reference
      uses ``N / P * GA_cur / spg`` with N the masked-token count of the whole generation batch over all ranks; for a
      token-exact mean over an optimizer step, pass the masked-token count of all that step's micro-batches summed
      over ranks (and undo DDP's gradient averaging by the world size in the module);
    * luspo: per-row token SUM, then mean over the B rows.

    ``num_items_in_batch`` is ignored by the other types.

    Args:
        logps: ``(B, T)`` policy log-probs of the completion tokens (with grad), 0 at padding.
        old_logps: ``(B, T)`` sampling-policy log-probs, or None when on-policy (then ``old = logps.detach()``: the
            ratio is 1 but keeps its gradient).
        advantages: ``(B,)`` or ``(B, 1)``.
        mask: ``(B, T)`` completion mask (bool or 0/1).
        **options: the :class:`~lit_trainer.losses.grpo_options.GRPOLossOptions`, keyword only (defaults in
            :data:`~lit_trainer.losses.grpo_options.GRPO_LOSS_DEFAULTS`):

            * ``loss_type``: see above (default "dapo").
            * ``epsilon``: lower clip ``eps`` (default 0.2); also the upper one when ``epsilon_high`` is None.
            * ``epsilon_high``: upper clip (DAPO "clip-higher"), and the CISPO cap.
            * ``delta``: cap of the unclipped ratio (two-sided GRPO), > 1; None = off.
            * ``beta``: KL coefficient (default 0.0); ``!= 0`` requires ``ref_logps``.
            * ``ref_logps``: ``(B, T)`` reference-model log-probs.
            * ``use_bias_correction_kl``: weight the k3 by the per-token ratio (DeepSeek-V3.2), default True as the
              reference.
            * ``importance_sampling_level``: "token" (default) or "sequence".
            * ``max_completion_length``: the Dr. GRPO constant; required for dr_grpo.
            * ``num_items_in_batch``: dapo/cispo/vespo normaliser (int, float or 0-dim tensor; no host sync).
            * ``sapo_temperature_pos``: SAPO temperature for A > 0 (reference default 1.0).
            * ``sapo_temperature_neg``: SAPO temperature for A <= 0 (reference default 1.05).
            * ``vespo_k_pos``: VESPO gamma-weight exponent ``k`` for A >= 0 (reference default 2.0).
            * ``vespo_lambda_pos``: VESPO rate ``lambda`` for A >= 0 (reference default 3.0).
            * ``vespo_k_neg``: VESPO ``k`` for A < 0 (reference default 3.0).
            * ``vespo_lambda_neg``: VESPO ``lambda`` for A < 0 (reference default 2.0).
            * ``policy_mask``: ``(B, T)`` or ``(B, 1)`` multiplier of the policy term (not of the KL), None = all 1.
            * ``importance_sampling_ratio``: ``(B, T)`` or ``(B, 1)`` sampler correction ``pi_old / pi_sampler`` of
              the policy term (see above; vespo needs ``(B, T)``), treated as a constant; None = no correction.

    Returns:
        0-dim loss tensor.

    Raises:
        TypeError: on a keyword that is not one of the options (named in the message).
        ValueError: as :func:`~lit_trainer.losses.grpo_options.check_loss_inputs` (an unknown loss type or level, a
            shape mismatch, ``beta != 0`` without ``ref_logps``, dr_grpo without ``max_completion_length``, a negative
            epsilon or beta, ``delta <= 1``, a non-positive SAPO temperature, vespo at sequence level, an
            ``importance_sampling_ratio`` that is not ``(B, T)`` or ``(B, 1)``, or ``(B, 1)`` with vespo).

    Example:
        >>> logps = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
        >>> grpo_policy_loss(logps, None, torch.tensor([1.0]), torch.tensor([[1, 1]]))  # on-policy: -mean(r A)
        tensor(-1., grad_fn=<DivBackward0>)
    """
    c = resolve_loss_options("grpo_policy_loss", options)
    check_loss_inputs(c, logps, old_logps, advantages, mask)
    loss_type, beta = c["loss_type"], c["beta"]
    mask_f = mask.to(logps.dtype)
    log_ratio = logps - (logps.detach() if old_logps is None else old_logps)
    ratio = torch.exp(_IS_LEVELS[c["importance_sampling_level"]](log_ratio, mask_f))
    adv = advantages.reshape(-1, 1).to(logps.dtype)
    is_ratio = c["importance_sampling_ratio"]
    if is_ratio is not None:
        is_ratio = is_ratio.detach()
    if loss_type == "vespo":  # weights the sequence by its own summed log-ratio (and the sampler's), not by `ratio`
        loss = -vespo_weights(log_ratio, mask_f, adv, vespo_shape(c), is_ratio) * adv * logps
    else:
        loss = _TOKEN_LOSSES[loss_type](ratio, adv, logps, c)
    if c["policy_mask"] is not None:  # entropy / off-policy masks: the policy term only, not the KL
        loss = loss * c["policy_mask"].to(loss.dtype)
    if is_ratio is not None and loss_type != "vespo":  # sampler correction: the policy term only, not the KL
        loss = loss * is_ratio.to(loss.dtype)
    if beta != 0:
        loss = loss + beta * _kl_term(logps, c["ref_logps"], log_ratio, c)
    return _AGGREGATORS[loss_type](loss, mask_f, c)


# ------------------------------------------------------------------------------------------------ loss metrics
def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _masked(x, mask).sum() / mask.sum().clamp(min=1.0)


def _row_extreme(x: Tensor, mask: Tensor, *, lowest: bool) -> Tensor:
    """Min (or max) over rows with at least one token of the per-row token fraction of ``x``; 0 if none."""
    counts = mask.sum(-1)
    frac = _masked(x, mask).sum(-1) / counts.clamp(min=1.0)
    value = frac.masked_fill(counts == 0, float("inf") if lowest else float("-inf"))
    value = value.min() if lowest else value.max()
    return torch.where(torch.isinf(value), torch.zeros_like(value), value)


@torch.no_grad()
def grpo_loss_metrics(
    logps: Tensor, old_logps: Tensor | None, advantages: Tensor, mask: Tensor, **options: Unpack[GRPOLossOptions]
) -> dict[str, Tensor]:
    """Per-micro-step loss metrics (TRL's GRPO metrics) as 0-dim tensors, without grad or host sync.

    Means are over this micro-batch's masked tokens; the caller averages them over micro-steps and ranks.

    * clipped types (grpo, bnpo, dr_grpo, dapo, luspo), with ``r`` after the ``delta`` cap:
      ``clip_ratio/low_mean`` = token mean of ``r < 1-eps & A < 0``, ``clip_ratio/high_mean`` = of
      ``r > 1+eps_high & A > 0``, ``clip_ratio/region_mean`` = of either; ``clip_ratio/low_min`` /
      ``clip_ratio/high_max`` = min / max over the rows (with at least one token) of the per-row fraction;
    * cispo: ``cispo_clip_ratio`` = token mean of ``r > eps_high & A > 0``;
    * vespo: ``vespo/phi_seq_mean`` = mean over the rows of :func:`vespo_weights` (with the
      ``importance_sampling_ratio`` folded in when given, as the reference's metric; the other metrics ignore it);
    * ``beta != 0``: ``kl`` = token mean of k3 (times the per-token ratio if ``use_bias_correction_kl``).

    Args:
        logps: as :func:`grpo_policy_loss` (detached here).
        old_logps: as :func:`grpo_policy_loss`.
        advantages: as :func:`grpo_policy_loss`.
        mask: as :func:`grpo_policy_loss`.
        **options: as :func:`grpo_policy_loss`; ``loss_type`` decides which keys are returned, ``kl`` is returned when
            ``beta`` is not 0. ``max_completion_length``, ``num_items_in_batch`` and the SAPO temperatures do not
            change the metrics (so dr_grpo does not need ``max_completion_length`` here).

    Returns:
        Dict of metric name to 0-dim tensor (only the keys that apply to ``loss_type`` and ``beta``).

    Raises:
        TypeError: as :func:`grpo_policy_loss`.
        ValueError: as :func:`grpo_policy_loss`.
    """
    # the Dr. GRPO constant does not affect the metrics: a placeholder passes validation when it is not given
    c = resolve_loss_options("grpo_loss_metrics", {"max_completion_length": 1, **options})
    check_loss_inputs(c, logps, old_logps, advantages, mask)
    loss_type, delta, beta = c["loss_type"], c["delta"], c["beta"]
    epsilon, eps_high = c["epsilon"], c["epsilon_high"]
    logps, mask_f, adv = logps.detach(), mask.to(logps.dtype), advantages.reshape(-1, 1)
    log_ratio = logps - (logps if old_logps is None else old_logps)
    ratio = torch.exp(_IS_LEVELS[c["importance_sampling_level"]](log_ratio, mask_f))
    metrics: dict[str, Tensor] = {}
    if loss_type in CLIPPED_LOSS_TYPES:
        capped = ratio if delta is None else ratio.clamp(max=delta)
        low = ((capped < 1.0 - epsilon) & (adv < 0)).to(logps.dtype)
        high = ((capped > 1.0 + eps_high) & (adv > 0)).to(logps.dtype)
        metrics["clip_ratio/low_mean"] = _token_mean(low, mask_f)
        metrics["clip_ratio/high_mean"] = _token_mean(high, mask_f)
        metrics["clip_ratio/region_mean"] = _token_mean(torch.maximum(low, high), mask_f)
        metrics["clip_ratio/low_min"] = _row_extreme(low, mask_f, lowest=True)
        metrics["clip_ratio/high_max"] = _row_extreme(high, mask_f, lowest=False)
    if loss_type == "vespo":
        is_ratio = c["importance_sampling_ratio"]
        metrics["vespo/phi_seq_mean"] = vespo_weights(log_ratio, mask_f, adv, vespo_shape(c), is_ratio).mean()
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = _token_mean(((ratio > eps_high) & (adv > 0)).to(logps.dtype), mask_f)
    if beta != 0:
        metrics["kl"] = _token_mean(_kl_term(logps, c["ref_logps"], log_ratio, c), mask_f)
    return metrics
