"""Token and sequence masks that select what the GRPO policy term trains on (TRL 1.16's ``top_entropy_quantile`` and
``off_policy_mask_threshold``), and the mean token entropy the entropy bonus maximises. Pure tensor functions.

Both masks multiply the per-token POLICY loss before the KL term is added (pass their product as
``grpo_policy_loss(..., policy_mask=...)``); the loss's normaliser still counts every completion token.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["high_entropy_mask", "masked_mean_entropy", "off_policy_mask"]


def high_entropy_mask(entropies: Tensor, mask: Tensor, pool: Tensor, quantile: float) -> Tensor:
    """Tokens whose entropy is at least the ``quantile``-quantile of ``pool`` (the paper "Beyond the 80/20 rule").

    GRPO's ``top_entropy_quantile = rho`` keeps the top-``rho`` fraction by entropy: pass ``quantile = 1 - rho``, and
    as ``pool`` the masked entropies of every rank's micro-batch (the reference gathers them across processes).
    ``torch.quantile`` interpolates linearly; a token ties in when its entropy equals the threshold.

    Args:
        entropies: ``(B, T)`` per-token entropies.
        mask: ``(B, T)`` completion mask.
        pool: 1-D entropies the threshold is the quantile of.
        quantile: in [0, 1].

    Returns:
        ``(B, T)`` bool mask, False on padding; all False when ``pool`` is empty.

    Example:
        >>> e = torch.tensor([[0.1, 0.5, 0.9, 0.3]])
        >>> high_entropy_mask(e, torch.ones(1, 4), e.flatten(), 0.5)  # median of the 4 is 0.4
        tensor([[False,  True,  True, False]])
    """
    if pool.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(pool.float(), quantile)
    return ((entropies * mask.float()) >= threshold) & mask.bool()


def off_policy_mask(advantages: Tensor, logps: Tensor, old_logps: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: keep a sequence iff ``A >= 0`` or its mean ``old - logp`` is at most
    ``threshold``.

    ``kl = sum_t m (old - sg(logp)) / max(1, sum_t m)`` per row (NaN tokens count as 0). With no stored old log-probs
    (on-policy) pass ``old_logps = logps.detach()``: every sequence is then kept.

    Args:
        advantages: ``(B,)`` or ``(B, 1)``.
        logps: ``(B, T)`` current policy log-probs (detached here).
        old_logps: ``(B, T)`` sampling-policy log-probs.
        mask: ``(B, T)`` completion mask.
        threshold: the ``delta`` of the paper (e.g. 0.5).

    Returns:
        ``(B, 1)`` mask in ``mask``'s float dtype (1 = keep).

    Example:
        >>> lp, old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]])), torch.zeros(2, 2)  # kl = ln 2 = 0.69
        >>> off_policy_mask(torch.tensor([1.0, -1.0]), lp, old, torch.ones(2, 2), 0.5)
        tensor([[1.],
                [0.]])
    """
    mask_f = mask.float()
    kl = torch.nan_to_num(old_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask_f).sum(-1, keepdim=True) / mask_f.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (advantages.reshape(-1, 1) >= 0) | (mean_kl <= threshold)
    return keep.to(mask_f.dtype)


def masked_mean_entropy(entropies: Tensor, mask: Tensor) -> Tensor:
    """``sum(H m) / max(1, sum m)``: the mean token entropy the GRPO entropy bonus adds (times ``-entropy_coef``).

    Example:
        >>> masked_mean_entropy(torch.tensor([[1.0, 3.0, 7.0]]), torch.tensor([[1, 1, 0]]))
        tensor(2.)
    """
    mask_f = mask.to(entropies.dtype)
    return (entropies * mask_f).sum() / mask_f.sum().clamp(min=1.0)
