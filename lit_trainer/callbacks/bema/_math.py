"""BEMA maths (TRL 1.16 ``BEMACallback`` numerics, see docs/design.md#trl-bema): coefficients and the fused update."""

from __future__ import annotations

import torch


def bema_coefficients(
    step: int, *, lag: float, multiplier: float, ema_power: float, bias_power: float, min_ema_multiplier: float
) -> tuple[float, float]:
    """TRL 1.16's coefficients ``beta_t = max((lag + multiplier t)^-ema_power, min_ema_multiplier)`` and
    ``alpha_t = (lag + multiplier t)^-bias_power``.

    Args:
        step: the 1-based absolute optimizer step ``t``; the other arguments are :class:`BEMA`'s.

    Returns:
        ``(beta_t, alpha_t)``: the EMA weight of ``theta_t`` and the weight of the bias correction.
    """
    base = lag + multiplier * step
    return max(base**-ema_power, min_ema_multiplier), base**-bias_power


@torch.no_grad()
def bema_update_(
    ema: list[torch.Tensor],
    bema: list[torch.Tensor],
    theta0: list[torch.Tensor],
    params: list[torch.Tensor],
    beta: float,
    alpha: float,
) -> None:
    """In place: ``ema <- (1-beta)*ema + beta*params``; ``bema <- ema + alpha*(params - theta0)``.

    ``bema`` doubles as the staging buffer for ``params`` (which may live on another device), so an update needs no
    memory beyond the three buffers: five fused ``torch._foreach_*`` calls, no per-parameter Python work.

    Args:
        ema, bema, theta0: the buffers, aligned with ``params``; ``ema`` and ``bema`` are overwritten.
        params: the current weights ``theta_t``.
        beta, alpha: from :func:`bema_coefficients`.
    """
    torch._foreach_copy_(bema, params)
    torch._foreach_lerp_(ema, bema, beta)
    torch._foreach_sub_(bema, theta0)
    torch._foreach_mul_(bema, alpha)
    torch._foreach_add_(bema, ema)
