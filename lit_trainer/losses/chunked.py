"""Per-token log-probabilities (and entropies) straight from the last hidden states, a chunk of tokens at a time.

A causal LM's head turns ``N`` hidden states into ``N x V`` logits; at a real vocabulary (Qwen2: 151,936) those
logits, their float32 log-softmax and their gradient are most of a training step's memory. :func:`chunked_token_logps`
never holds more than one chunk's ``chunk_size x V`` logits: the forward pass keeps only each token's log-sum-exp, and
the backward pass recomputes one chunk's logits at a time to form the gradients of the hidden states, the head weight
and bias. Pure PyTorch: it runs wherever the model runs.

The arithmetic is the full path's, chunk by chunk: logits in the head's dtype, upcast to at least float32 (float64
stays float64), divided by ``temperature``; ``logp = z[target] - logsumexp(z)``; entropy
``H = logsumexp(z) - sum(p z)``.
Gradients: ``d logp / dz = onehot(target) - p`` and ``dH / dz = -p (z - sum(p z))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunked_token_logps", "default_chunk_size"]

_CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB in float32, whatever the vocabulary


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's float32 logits take about 64 MiB (at least 16 tokens)."""
    return max(16, _CHUNK_ELEMENTS // max(vocab_size, 1))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = F.linear(hidden, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z / temperature if temperature != 1.0 else z


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy):  # type: ignore[override]
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logps = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            z = _chunk_logits(hidden[start:stop], weight, bias, temperature)
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            logps[start:stop] = z.gather(-1, targets[start:stop, None])[:, 0] - lse[start:stop]
            if with_entropy:
                p = torch.exp(z - lse[start:stop, None])
                entropy[start:stop] = lse[start:stop] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=accumulate) if need_bias and bias is not None else None
        with_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel()
        for start in range(0, hidden.shape[0], chunk_size):
            stop = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:stop]
            z = _chunk_logits(h, weight, bias, temperature)
            p = torch.exp(z - lse[start:stop, None])
            g_logp = grad_logps[start:stop, None].to(z.dtype)
            g = p * -g_logp
            g.scatter_add_(-1, targets[start:stop, None], g_logp)
            if with_entropy:
                expected = (p * z).sum(-1, keepdim=True)
                g -= grad_entropy[start:stop, None].to(z.dtype) * p * (z - expected)
            if temperature != 1.0:
                g /= temperature
            if grad_hidden is not None:
                grad_hidden[start:stop] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += g.T.to(accumulate) @ h.to(accumulate)
            if grad_bias is not None:
                grad_bias += g.sum(0).to(accumulate)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_token_logps(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(hidden @ weight.T + bias) / temperature`` at ``targets``, without the full logits.

    Args:
        hidden: ``(..., H)`` last hidden states (the positions that predict ``targets``).
        weight: ``(V, H)`` output head weight.
        targets: ``(...)`` token ids, valid everywhere (replace ignored positions, e.g. ``-100``, by any id and mask
            the result).
        bias: ``(V,)`` head bias, if any.
        temperature: divides the logits (> 0).
        chunk_size: tokens per chunk (default :func:`default_chunk_size`: about 64 MiB of float32 logits).
        with_entropy: also return each position's entropy (with its gradient).

    Returns:
        ``(logps, entropy)`` shaped like ``targets`` (entropy None unless asked), float32 (float64 for float64
        inputs). Differentiable with respect to ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: on ``temperature <= 0``, ``chunk_size < 1`` or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature={temperature}` is invalid: it must be > 0.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"`chunk_size={chunk_size}` is invalid: use >= 1 tokens, or None for the default.")
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets {tuple(targets.shape)} do not "
            "match: expected (..., H), (V, H) and (...)."
        )
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    size = chunk_size or default_chunk_size(weight.shape[0])
    logps, entropy = _ChunkedHead.apply(
        flat_hidden, weight, bias, targets.reshape(-1).long(), float(temperature), size, with_entropy
    )
    return logps.reshape(shape), entropy.reshape(shape) if with_entropy else None
