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

__all__ = ["chunked_logp_sum", "chunked_token_logps", "default_chunk_size"]

_CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB in float32, whatever the vocabulary


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's float32 logits take about 64 MiB (at least 16 tokens)."""
    return max(16, _CHUNK_ELEMENTS // max(vocab_size, 1))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """A fresh ``(c, V)`` tensor of logits / temperature (at least float32): callers may overwrite it."""
    z = F.linear(hidden, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.div_(temperature) if temperature != 1.0 else z


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` without a ``(c, V)`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2))[:, 0, 0]


def _chunk_gradients(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor | None,
    g_logp: Tensor,
    g_entropy: Tensor | None,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk: ``(logps, d/dlogits)`` for upstream gradients ``g_logp`` (and ``g_entropy``) per token.

    Works in place: one ``(c, V)`` buffer (two with the entropy term)."""
    z = _chunk_logits(h, weight, bias, temperature)
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)
    logps = z.gather(-1, target[:, None])[:, 0] - lse
    g_logp = g_logp[:, None].to(z.dtype)
    if g_entropy is None:
        g = z.sub_(lse[:, None]).exp_().mul_(-g_logp)  # p * -g_logp, in z's buffer
    else:
        p = (z - lse[:, None]).exp_()
        entropy_part = z.sub_(_row_dot(p, z)[:, None]).mul_(p).mul_(g_entropy[:, None].to(z.dtype))  # p (z - E[z])
        g = p.mul_(-g_logp).sub_(entropy_part)
    g.scatter_add_(-1, target[:, None], g_logp)
    if temperature != 1.0:
        g.div_(temperature)
    return logps, g


class _Grads:
    """Gradient buffers of the head's inputs, filled chunk by chunk."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: tuple[bool, ...]) -> None:
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        self.hidden = torch.zeros_like(hidden) if needs[0] else None
        self.weight = torch.zeros_like(weight, dtype=accumulate) if needs[1] else None
        self.bias = torch.zeros_like(bias, dtype=accumulate) if needs[2] and bias is not None else None

    def add(self, start: int, stop: int, h: Tensor, weight: Tensor, g: Tensor) -> None:
        if self.hidden is not None:
            self.hidden[start:stop] = (g.to(weight.dtype) @ weight).to(self.hidden.dtype)
        if self.weight is not None:
            self.weight += g.T.to(self.weight.dtype) @ h.to(self.weight.dtype)
        if self.bias is not None:
            self.bias += g.sum(0).to(self.bias.dtype)

    def result(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        w = self.weight.to(weight.dtype) if self.weight is not None else None
        b = self.bias.to(bias.dtype) if self.bias is not None else None
        return self.hidden, w, b


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
                p = (z - lse[start:stop, None]).exp_()
                entropy[start:stop] = lse[start:stop] - _row_dot(p, z)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.set_materialize_grads(False)  # an unused output (e.g. a detached entropy) gets None, not zeros
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grads = _Grads(hidden, weight, bias, ctx.needs_input_grad[:3])
        with_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel()
        if grad_logps is None:
            grad_logps = lse.new_zeros(lse.shape)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:stop]
            g_entropy = grad_entropy[start:stop] if with_entropy else None
            _, g = _chunk_gradients(
                h, weight, bias, targets[start:stop], lse[start:stop], grad_logps[start:stop], g_entropy,
                ctx.temperature,
            )  # fmt: skip
            grads.add(start, stop, h, weight, g)
        return *grads.result(weight, bias), None, None, None, None


class _ChunkedLogpSum(torch.autograd.Function):
    """``sum_t w_t logp_t`` with the gradients formed in the forward pass (the weights are known there), so the
    backward pass only scales them: no logits are recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, temperature, chunk_size):  # type: ignore[override]
        grads = _Grads(hidden, weight, bias, ctx.needs_input_grad[:3])
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        for start in range(0, hidden.shape[0], chunk_size):
            stop = min(start + chunk_size, hidden.shape[0])
            h, w = hidden[start:stop], weights[start:stop]
            logps, g = _chunk_gradients(h, weight, bias, targets[start:stop], None, w, None, temperature)
            total += (logps * w.to(logps.dtype)).sum()
            grads.add(start, stop, h, weight, g)
        ctx.grads = grads.result(weight, bias)
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        scaled = [g * grad_total.to(g.dtype) if g is not None else None for g in ctx.grads]
        ctx.grads = None
        return *scaled, None, None, None, None


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int | None) -> None:
    if temperature <= 0:
        raise ValueError(f"`temperature={temperature}` is invalid: it must be > 0.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"`chunk_size={chunk_size}` is invalid: use >= 1 tokens, or None for the default.")
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets {tuple(targets.shape)} do not "
            "match: expected (..., H), (V, H) and (...)."
        )


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
    _check(hidden, weight, targets, temperature, chunk_size)
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    size = chunk_size or default_chunk_size(weight.shape[0])
    logps, entropy = _ChunkedHead.apply(
        flat_hidden, weight, bias, targets.reshape(-1).long(), float(temperature), size, with_entropy
    )
    return logps.reshape(shape), entropy.reshape(shape) if with_entropy else None


def chunked_logp_sum(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    weights: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """``sum_t weights_t * log p(targets_t)`` (a 0-dim tensor), without the full logits and without recomputing them.

    The SFT loss is ``-chunked_logp_sum(h, W, y, mask) / num_items``: because the weight of every token's
    log-probability is known before the backward pass, the gradients are formed chunk by chunk in the forward pass
    and the backward pass only scales them (the cost of the full path's three head products, not four). Holds the
    head's gradient (``V x H``) between the two passes.

    Args:
        hidden: ``(..., H)`` last hidden states.
        weight: ``(V, H)`` output head weight.
        targets: ``(...)`` token ids, valid everywhere.
        weights: ``(...)`` the weight of each log-probability (e.g. the loss mask).
        bias: ``(V,)`` head bias, if any.
        temperature: divides the logits (> 0).
        chunk_size: tokens per chunk (default: about 64 MiB of float32 logits).

    Raises:
        ValueError: as :func:`chunked_token_logps`, or ``weights`` not shaped like ``targets``.
    """
    _check(hidden, weight, targets, temperature, chunk_size)
    if weights.shape != targets.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must be shaped like targets {tuple(targets.shape)}.")
    size = chunk_size or default_chunk_size(weight.shape[0])
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLogpSum.apply(
        flat_hidden, weight, bias, targets.reshape(-1).long(), weights.reshape(-1), float(temperature), size
    )
