"""Per-token log-probabilities of given labels, without materialising a full log-softmax copy.

Shared by the DPO and GRPO losses and modules: both need ``log p(label_t | context)`` per position.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def shift_for_next_token(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align logits with next-token labels: position ``t`` predicts ``labels[t + 1]``.

    Args:
        logits: ``(B, T, V)`` model outputs.
        labels: ``(B, T)`` unshifted labels (``-100`` = ignored).

    Returns:
        ``(logits[:, :-1], labels[:, 1:])``.
    """
    return logits[:, :-1, :], labels[:, 1:]


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature).gather(-1, index)`` computed row by row.

    Equivalent to ``torch.log_softmax(logits.float() / temperature, -1).gather(-1, index[..., None])[..., 0]`` but
    only one ``(T, V)`` float32 slice is alive at a time, instead of a full ``(B, T, V)`` log-softmax copy.

    Args:
        logits: ``(B, T, V)`` logits, any float dtype (upcast to at least float32 per row; float64 stays float64).
        index: ``(B, T)`` token ids; entries must be valid ids (mask ``-100`` out before calling).
        temperature: divides the logits; must be > 0.

    Returns:
        ``(B, T)`` float32 log-probabilities (float64 for float64 logits).

    Raises:
        ValueError: if ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature={temperature}` is invalid: it must be > 0.")
    rows = []
    for row_logits, row_index in zip(logits, index):
        row = row_logits.to(torch.promote_types(row_logits.dtype, torch.float32))
        if temperature != 1.0:
            row = row / temperature
        picked = row.gather(-1, row_index.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(rows)


def per_token_logps(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted per-token log-probs of ``labels`` and the matching mask.

    Args:
        logits: ``(B, T, V)`` outputs of a causal LM on ``input_ids``.
        labels: ``(B, T)`` unshifted labels, ``-100`` where no loss is taken (prompt, padding).
        temperature: logits are divided by it (GRPO uses the sampling temperature; DPO uses 1).

    Returns:
        ``(logps, mask)``, both ``(B, T - 1)``: ``logps[b, t] = log p(labels[b, t + 1] | input[b, :t + 1])``, 0 where
        ``mask`` is False.
    """
    shifted_logits, shifted_labels = shift_for_next_token(logits, labels)
    mask = shifted_labels != IGNORE_INDEX
    safe = shifted_labels.masked_fill(~mask, 0)
    logps = selective_log_softmax(shifted_logits, safe, temperature)
    return logps.masked_fill(~mask, 0.0), mask
