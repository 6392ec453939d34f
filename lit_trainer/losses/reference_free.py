"""Reference-free preference losses: ORPO's odds-ratio term and the CPO family (CPO, SimPO, AlphaPO), as TRL 1.16's
experimental ``ORPOTrainer`` and ``CPOTrainer`` compute them. No reference model: each pair is scored by the policy
alone.

Notation (pair ``i``): ``π_c, π_r`` are the policy's per-sequence log-probs of the chosen and rejected completion,
SUMMED over completion tokens or AVERAGED per completion token as each loss says (the module picks the right one:
ORPO, CPO's ``ipo``, ``simpo`` and ``alphapo`` average; CPO's ``sigmoid`` and ``hinge`` sum); ``β = beta``,
``ε = label_smoothing``, ``γ = simpo_gamma``, ``α = alpha`` (AlphaPO's reward shape), ``σ`` the sigmoid. The NLL
(SFT) term both methods add on the chosen tokens is a token mean, computed by the module, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F

CPOLossType = Literal["sigmoid", "hinge", "ipo", "simpo", "alphapo"]
CPO_LOSS_TYPES: tuple[str, ...] = get_args(CPOLossType)
#: loss types that take per-token AVERAGED log-probs (TRL's ``average_log_prob``); the others take sums
AVERAGED_LOSS_TYPES: tuple[str, ...] = ("ipo", "simpo", "alphapo")
#: loss types that accept ``label_smoothing > 0`` (TRL ignores it, with a warning, for hinge and ipo)
SMOOTHED_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "simpo", "alphapo")

_LN2 = 0.6931471805599453
# ORPO's log-odds need log(1 − p); at p == 1 (a log-prob rounded to exactly 0, which a confident float32 model
# produces) TRL's log(1 − exp(x)) is −inf and its gradient NaN. Log-probs are capped just below 0 inside the odds.
_LOGP_CAP = -1e-7


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − eˣ)`` for ``x < 0``, accurate on both sides of ``−ln 2`` (``log1p(−eˣ)`` below, ``log(−expm1 x)``
    above); both branches are evaluated on safe inputs so no NaN reaches the gradient of the branch not taken."""
    far = x < -_LN2
    below = torch.where(far, x, torch.full_like(x, -1.0))
    above = torch.where(far, torch.full_like(x, -0.5), x)
    return torch.where(far, torch.log1p(-torch.exp(below)), torch.log(-torch.expm1(above)))


def orpo_log_odds(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> torch.Tensor:
    """ORPO's log odds ratio per pair, ``log(odds_c / odds_r)`` with ``odds = p / (1 − p)`` and ``log p = π``
    (AVERAGED per-token log-probs):

        ``L = (π_c − π_r) − (log(1 − e^{π_c}) − log(1 − e^{π_r}))``

    computed in float32 at least, with ``log(1 − eˣ)`` evaluated stably (``log1p``/``expm1`` split at ``−ln 2``) and
    ``π`` capped at ``−1e-7`` (TRL gives NaN gradients when a chosen completion's probability rounds to 1).

    Example:
        >>> round(orpo_log_odds(torch.tensor([-0.5]), torch.tensor([-2.0])).item(), 4)  # log(1.5415) - log(0.1565)
        2.2873
    """
    _check_pair(chosen_logps, rejected_logps, "orpo_log_odds")
    dtype = torch.promote_types(chosen_logps.dtype, torch.float32)
    pc = chosen_logps.to(dtype).clamp(max=_LOGP_CAP)
    pr = rejected_logps.to(dtype).clamp(max=_LOGP_CAP)
    return (pc - pr) - (_log1mexp(pc) - _log1mexp(pr))


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float = 0.1) -> torch.Tensor:
    """ORPO's odds-ratio term per pair (TRL 1.16 ``ORPOTrainer``; ``β`` is the paper's ``λ``):

        ``ℓ_OR = −β · log σ(L)``,  with ``L`` = :func:`orpo_log_odds` of the AVERAGED log-probs.

    The full ORPO loss is ``NLL(chosen) + mean_pairs ℓ_OR`` (TRL: ``nll_loss − mean(β log σ(L))``); the NLL token mean
    is the module's.

    Args:
        chosen_logps: ``(B,)`` per-token averaged log-probs of the chosen completions (all ``< 0``).
        rejected_logps: ``(B,)`` the same for the rejected completions.
        beta: ``β`` (``λ``), the weight of the odds-ratio term, > 0.

    Returns:
        ``(B,)`` per-pair losses.

    Raises:
        ValueError: a non-positive ``beta`` or mismatched shapes.

    Example:
        >>> round(orpo_loss(torch.tensor([-0.5]), torch.tensor([-2.0]), beta=0.1).item(), 5)  # -0.1 log σ(2.2876)
        0.00967
    """
    if not beta > 0:
        raise ValueError(f"`orpo_loss(beta={beta})` is invalid: beta (ORPO's lambda) must be > 0, e.g. 0.1.")
    return -beta * F.logsigmoid(orpo_log_odds(chosen_logps, rejected_logps))


def cpo_rewards(logps: torch.Tensor, alpha: float = 0.0) -> torch.Tensor:
    """The implicit reward of CPO's losses: ``π`` itself, or with AlphaPO's shape (``α ≠ 0``)
    ``r = (1 − p^{−α}) / α = −expm1(−α·π) / α`` (``p = e^π``; the ``expm1`` form is TRL's value, and stays finite
    where ``e^π`` underflows to 0 and TRL's ``p.pow(−α)`` turns infinite).

    Example:
        >>> cpo_rewards(torch.tensor([-1.0]), alpha=0.5)  # (1 - e^{0.5}) / 0.5
        tensor([-1.2974])
    """
    if alpha == 0.0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha


def _logistic(z: torch.Tensor, eps: float) -> torch.Tensor:
    """``−(1−ε)·logσ(z) − ε·logσ(−z)``: the logistic loss with label smoothing ``ε`` (conservative DPO)."""
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


_CPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float, float], torch.Tensor]] = {
    # (Δ, β, ε, γ) -> per-pair loss; Δ = r_c − r_r
    "sigmoid": lambda d, beta, eps, gamma: _logistic(beta * d, eps),
    "hinge": lambda d, beta, eps, gamma: torch.relu(1.0 - beta * d),
    "ipo": lambda d, beta, eps, gamma: (d - 1.0 / (2.0 * beta)) ** 2,
    "simpo": lambda d, beta, eps, gamma: _logistic(beta * (d - gamma / beta), eps),
    "alphapo": lambda d, beta, eps, gamma: _logistic(beta * (d - gamma / beta), eps),
}


def _check_pair(chosen: torch.Tensor, rejected: torch.Tensor, name: str) -> None:
    if chosen.dim() != 1 or chosen.shape != rejected.shape:
        raise ValueError(
            f"`{name}` needs two 1-D per-sequence log-prob tensors of the same shape (B,), got "
            f"{tuple(chosen.shape)} and {tuple(rejected.shape)}."
        )


def check_cpo_options(loss_type: str, beta: float, label_smoothing: float, alpha: float) -> None:
    """Validate CPO options (the module calls it at construction).

    Raises:
        ValueError: naming the bad value and the fix.
    """
    if loss_type not in _CPO_LOSSES:
        raise ValueError(f"`loss_type={loss_type!r}` is invalid for CPO: choose one of {CPO_LOSS_TYPES}.")
    if not beta > 0:
        raise ValueError(f"`beta={beta}` is invalid for CPO: it must be > 0 (ipo and simpo divide by it).")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"`label_smoothing={label_smoothing}` is invalid for CPO: it must be in [0, 1).")
    if label_smoothing > 0 and loss_type not in SMOOTHED_LOSS_TYPES:
        raise ValueError(
            f"`label_smoothing={label_smoothing}` does nothing with loss_type={loss_type!r} (TRL ignores it with a "
            f"warning): set label_smoothing=0.0, or use one of {SMOOTHED_LOSS_TYPES}."
        )
    if loss_type == "alphapo" and alpha == 0.0:
        raise ValueError(
            "`loss_type='alphapo'` with alpha=0.0 is plain SimPO: set a non-zero alpha (e.g. 0.1) or use "
            "loss_type='simpo'."
        )


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    loss_type: CPOLossType = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> torch.Tensor:
    """CPO's pair term per pair (TRL 1.16 ``CPOTrainer.cpo_loss``), with ``r = cpo_rewards(π, α)`` and
    ``Δ = r_c − r_r``:

    - ``sigmoid`` (CPO): ``−(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)``, ``π`` SUMMED;
    - ``hinge`` (SLiC): ``max(0, 1 − βΔ)``, ``π`` summed;
    - ``ipo``: ``(Δ − 1/(2β))²``, ``π`` AVERAGED;
    - ``simpo`` (SimPO): ``−(1−ε)·logσ(βΔ − γ) − ε·logσ(−(βΔ − γ))``, ``π`` averaged;
    - ``alphapo``: ``simpo`` with AlphaPO's reward shape (``α ≠ 0``); in TRL a shorthand for ``simpo`` with
      ``cpo_alpha = 0``.

    The full CPO loss adds ``cpo_alpha · NLL(chosen completion)`` (token mean; the module's): SimPO is ``simpo`` with
    ``cpo_alpha = 0``.

    Args:
        chosen_logps: ``(B,)`` per-sequence log-probs of the chosen completions (summed or averaged, see above).
        rejected_logps: ``(B,)`` the same for the rejected completions.
        loss_type: one of :data:`CPO_LOSS_TYPES`.
        beta: ``β`` > 0.
        label_smoothing: ``ε`` in [0, 1), for sigmoid, simpo and alphapo only.
        simpo_gamma: ``γ``, SimPO's target reward margin (simpo and alphapo).
        alpha: ``α``, AlphaPO's reward shape; 0 = the log-probs themselves (any loss type).

    Returns:
        ``(B,)`` per-pair losses.

    Raises:
        ValueError: an unknown loss type, ``beta <= 0``, ``label_smoothing`` outside [0, 1) or set for hinge/ipo,
            ``alphapo`` with ``alpha == 0``, or mismatched shapes.

    Example:
        >>> d = cpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), loss_type="simpo", beta=2.0, simpo_gamma=1.0)
        >>> round(d.item(), 4)  # -log σ(2 · 1 - 1)
        0.3133
    """
    check_cpo_options(loss_type, beta, label_smoothing, alpha)
    _check_pair(chosen_logps, rejected_logps, "cpo_loss")
    delta = cpo_rewards(chosen_logps, alpha) - cpo_rewards(rejected_logps, alpha)
    return _CPO_LOSSES[loss_type](delta, beta, label_smoothing, simpo_gamma)
