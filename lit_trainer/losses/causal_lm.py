"""Causal-LM cross entropy with a token-sum normaliser (docs/design.md#hf-num-items)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_trainer.losses.logprobs import IGNORE_INDEX


def count_target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of loss positions after the causal shift: ``(labels[..., 1:] != -100).sum()``."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    r"""Next-token cross entropy: ``sum_t CE(logits[t], labels[t+1]) / num_items_in_batch``.

    .. math:: \mathcal{L} = \frac{1}{N} \sum_{b,t:\ y_{b,t+1} \neq -100} -\log p_\theta(y_{b,t+1} \mid x_{b,\le t})

    Labels are shifted by one inside (position 0 is never a target), ``-100`` is ignored, logits are upcast to at
    least float32 (float64 stays float64: a float64 run is a float64 reference). With ``num_items_in_batch=None``
    the token mean of this batch is returned (``N`` = its target count); given the target count of a whole
    accumulation window (and all ranks), the per-micro-batch values add up to the full-batch token mean, which is
    what makes gradient accumulation token-exact.

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)`` unshifted, ``-100`` = ignored.
        num_items_in_batch: the normaliser ``N``; ``None`` for the local token mean.

    Returns:
        A 0-dim float32 tensor (float64 for float64 logits; 0 when there is no target token).
    """
    shifted_logits = logits[..., :-1, :].reshape(-1, logits.size(-1))
    shifted_logits = shifted_logits.to(torch.promote_types(shifted_logits.dtype, torch.float32))
    shifted_labels = labels[..., 1:].reshape(-1)
    total = F.cross_entropy(shifted_logits, shifted_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = (shifted_labels != IGNORE_INDEX).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / torch.clamp(torch.as_tensor(num_items_in_batch, device=total.device), min=1)
