"""KTO losses (every loss type of TRL 1.16's ``KTOTrainer``) and the KL estimate they use.

Notation (example ``i`` of an unpaired batch): ``π_i`` and ``ρ_i`` are the policy's and the reference model's summed
log-probs of the example's completion given its prompt, ``u_i = π_i − ρ_i`` the log-ratio, ``y_i`` its label (True =
desirable, False = undesirable), ``β = beta``, ``σ`` the sigmoid, ``λ_D, λ_U`` the desirable and undesirable weights.
``z₀`` is the reference point of KTO: an estimate of ``KL(π‖ρ)``, the mean log-ratio of MISMATCHED pairs ``(x_i, y_j)``
(a prompt with the completion of another example of the batch), detached and clamped at 0:

    z₀ = max(0, mean_k(π(y'_k | x_k) − ρ(y'_k | x_k)))

The mean runs over every mismatched pair of the micro-batch on every rank (the caller all-reduces the sums and
counts of :func:`kto_kl_terms`; this module stays free of collectives).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

KTOLossType = Literal["kto", "apo_zero_unpaired"]
KTO_LOSS_TYPES: tuple[str, ...] = get_args(KTOLossType)
#: loss types whose loss reads the KL estimate ``z₀`` (the others need no mismatched pairs)
KL_LOSS_TYPES: tuple[str, ...] = ("kto",)

# (u, z0, beta) -> (loss if desirable, loss if undesirable), elementwise
_Terms = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def _kto(u: torch.Tensor, z0: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return 1 - torch.sigmoid(beta * (u - z0)), 1 - torch.sigmoid(beta * (z0 - u))


def _apo_zero_unpaired(u: torch.Tensor, z0: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return 1 - torch.sigmoid(beta * u), torch.sigmoid(beta * u)


_LOSSES: dict[str, _Terms] = {"kto": _kto, "apo_zero_unpaired": _apo_zero_unpaired}


def check_kto_options(loss_type: str, beta: float, desirable_weight: float, undesirable_weight: float) -> None:
    """Validate the options of :func:`kto_loss` (also called by ``KTOModule`` at construction).

    Raises:
        ValueError: an unknown ``loss_type``, ``beta <= 0`` or a negative weight, naming the value and the fix.
    """
    if loss_type not in _LOSSES:
        raise ValueError(f"`kto_loss(loss_type={loss_type!r})` is invalid: choose one of {KTO_LOSS_TYPES}.")
    if not beta > 0:
        raise ValueError(f"`kto_loss(beta={beta})` is invalid: beta must be > 0 (TRL's default is 0.1).")
    for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not weight >= 0:
            raise ValueError(f"`kto_loss({name}={weight})` is invalid: use a weight >= 0 (default 1.0).")


def label_balance_problem(
    desirable: int, undesirable: int, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> str | None:
    """What the training data's labels break in KTO's assumptions, as a sentence naming the counts, or None.

    * One kind only: KTO contrasts desirable completions (pushed above the reference point, the KL estimate ``z0``)
      with undesirable ones (pushed below it), and ``desirable_weight``/``undesirable_weight`` balance the two kinds'
      losses; with one kind nothing is pushed the other way and the weights have nothing to balance.
    * Both kinds in unequal numbers: TRL 1.16's check (the KTO paper's Eq. 8, ``λ_D n_D / (λ_U n_U)`` in [1, 4/3]):
      a problem when neither weight is in the range that balances the counts (bounds rounded to 2 decimals, as TRL).

    Example:
        >>> label_balance_problem(10, 10) is None
        True
        >>> label_balance_problem(40, 0)[:55]
        'the training data has 40 desirable and 0 undesirable ro'
    """
    counts = f"the training data has {desirable} desirable and {undesirable} undesirable rows"
    if desirable == 0 or undesirable == 0:
        missing, other = ("undesirable", "down") if undesirable == 0 else ("desirable", "up")
        return (
            f"{counts}: KTO contrasts the two kinds around a reference point (the KL estimate z0: a desirable "
            "completion is pushed above it, an undesirable one below it), and desirable_weight/undesirable_weight "
            f"balance their losses; with one kind only, no completion is pushed {other} and the weights have nothing "
            f"to balance. Add {missing} rows (label {missing == 'desirable'}), or train CausalLMModule (SFT) on the "
            "desirable completions."
        )
    if desirable == undesirable:
        return None
    ratio = undesirable * undesirable_weight / desirable
    des_low, des_high = round(ratio, 2), round(ratio * 1.33, 2)
    und_low, und_high = (
        round(desirable * desirable_weight / undesirable / 1.33, 2),
        round(desirable * desirable_weight / undesirable, 2),
    )
    if des_low <= desirable_weight <= des_high or und_low <= undesirable_weight <= und_high:
        return None
    return (
        f"{counts}, which desirable_weight={desirable_weight} and undesirable_weight={undesirable_weight} do not "
        "balance: KTO (the paper's Eq. 8, as TRL checks) wants desirable_weight x desirable rows / (undesirable_weight "
        f"x undesirable rows) in [1, 4/3]. Set desirable_weight in [{des_low}, {des_high}] or undesirable_weight in "
        f"[{und_low}, {und_high}] (not both)."
    )


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor | float | None = None,
    *,
    loss_type: KTOLossType = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """Per-example KTO losses, weighted, in the batch's row order.

    * ``kto`` (KTO paper, eq. 7): ``λ_D (1 − σ(β(u − z₀)))`` for a desirable example, ``λ_U (1 − σ(β(z₀ − u)))`` for
      an undesirable one.
    * ``apo_zero_unpaired`` (APO-zero, unpaired): ``λ_D (1 − σ(βu))`` and ``λ_U σ(βu)``; no KL estimate.

    TRL 1.16 takes the mean of these over the batch (desirable examples first; the order does not change a mean).
    ``z₀ = max(0, kl)``: pass the mean mismatched-pair log-ratio (:func:`kto_kl_terms`, summed over the batch and the
    ranks); it is clamped here and never differentiated.

    Args:
        logps: ``(B,)`` policy per-sequence completion log-probs ``π``.
        ref_logps: ``(B,)`` reference log-probs ``ρ``.
        labels: ``(B,)`` bool (True = desirable).
        kl: the KL estimate (a 0-dim tensor or a float, or ``(B,)`` per example); required by ``kto``, ignored by
            ``apo_zero_unpaired``.
        loss_type: ``"kto"`` or ``"apo_zero_unpaired"``.
        beta: ``β`` (> 0).
        desirable_weight: ``λ_D`` (>= 0).
        undesirable_weight: ``λ_U`` (>= 0).

    Returns:
        ``(B,)`` losses in the dtype of ``logps``.

    Raises:
        ValueError: invalid options (see :func:`check_kto_options`), mismatched shapes, or ``kl=None`` with ``kto``.

    Example:
        >>> kto_loss(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]), torch.tensor([True, False]), 0.0,
        ...          beta=1.0)  # u = (1, -1): both 1 - σ(1)
        tensor([0.2689, 0.2689])
    """
    check_kto_options(loss_type, beta, desirable_weight, undesirable_weight)
    if logps.shape != ref_logps.shape or logps.shape != labels.shape or logps.dim() != 1:
        raise ValueError(
            f"`kto_loss` needs 1-D logps, ref_logps and labels of one shape; got {tuple(logps.shape)}, "
            f"{tuple(ref_logps.shape)} and {tuple(labels.shape)}."
        )
    if kl is None and loss_type in KL_LOSS_TYPES:
        raise ValueError(
            f"`kto_loss(loss_type={loss_type!r})` needs the KL estimate `kl` (the mean log-ratio of mismatched "
            "prompt/completion pairs, see `kto_kl_terms`); pass it, or use loss_type='apo_zero_unpaired'."
        )
    z0 = torch.as_tensor(0.0 if kl is None else kl, dtype=logps.dtype, device=logps.device).detach().clamp(min=0)
    desirable, undesirable = _LOSSES[loss_type](logps - ref_logps, z0, beta)
    labels = labels.to(device=logps.device, dtype=torch.bool)
    return torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)


def kto_kl_terms(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """``[Σ_k (π'_k − ρ'_k), n]`` of a batch's mismatched pairs, detached, float32: sum them over micro-batches or
    ranks, then ``sum / n`` is the estimate :func:`kto_loss` takes as ``kl``.

    Args:
        kl_logps: ``(K,)`` policy log-probs of the mismatched completions ``π(y'_k | x_k)``.
        ref_kl_logps: ``(K,)`` the reference model's.

    Example:
        >>> kto_kl_terms(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
        tensor([-0.5000,  2.0000])
    """
    if kl_logps.shape != ref_kl_logps.shape or kl_logps.dim() != 1:
        raise ValueError(
            f"`kto_kl_terms` needs two 1-D tensors of one shape; got {tuple(kl_logps.shape)} and "
            f"{tuple(ref_kl_logps.shape)}."
        )
    diff = (kl_logps - ref_kl_logps).detach().float()
    return torch.stack([diff.sum(), torch.tensor(float(diff.numel()), device=diff.device)])


def kto_kl(terms: torch.Tensor) -> torch.Tensor:
    """The KL estimate ``sum / n`` of (summed) :func:`kto_kl_terms`, unclamped (0 when there is no pair)."""
    return terms[0] / terms[1].clamp(min=1)


def kto_rewards_metrics(
    logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, beta: float
) -> dict[str, torch.Tensor]:
    """TRL's KTO reward metrics of one batch, detached 0-dim tensors (0 for a side the batch has no example of).

    Returns:
        ``rewards/chosen = mean(βu)`` over desirable examples, ``rewards/rejected`` over undesirable ones,
        ``rewards/margins`` their difference, ``logps/chosen`` and ``logps/rejected`` the mean ``π`` of each side.
    """
    labels = labels.to(device=logps.device, dtype=torch.bool)
    rewards = beta * (logps - ref_logps).detach().float()
    pi = logps.detach().float()
    metrics = {}
    for side, mask in (("chosen", labels), ("rejected", ~labels)):
        count = mask.sum().clamp(min=1)
        metrics[f"rewards/{side}"] = (rewards * mask).sum() / count
        metrics[f"logps/{side}"] = (pi * mask).sum() / count
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics
