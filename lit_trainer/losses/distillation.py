"""Generalised Jensen-Shannon divergence between a student's and a teacher's next-token distributions (GKD).

:func:`generalized_jsd_loss` is the divergence of TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (and, per token, of
``DistillationTrainer``'s chunked kernel) on full logits; :func:`chunked_token_divergence` computes the same per-token
values from the last hidden states and the two output heads a chunk of tokens at a time, so the ``N x V`` logits of
both models never exist at once (forward or backward).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lit_trainer.losses.logprobs import IGNORE_INDEX

__all__ = ["JSDReduction", "chunked_token_divergence", "generalized_jsd_loss", "token_divergence"]

JSDReduction = Literal["batchmean", "sum", "mean", "none"]
_CHUNK_ELEMENTS = 1 << 24  # logits per chunk and model: 64 MiB in float32, whatever the vocabulary


def _check(beta: float, temperature: float, reduction: str = "batchmean") -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"`beta={beta}` is invalid: use a value in [0, 1] (0 = forward KL, 1 = reverse KL).")
    if temperature <= 0:
        raise ValueError(f"`temperature={temperature}` is invalid: it must be > 0.")
    if reduction not in get_args(JSDReduction):
        raise ValueError(f"`reduction={reduction!r}` is invalid: use one of {get_args(JSDReduction)}.")


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / T)`` in at least float32 (float64 stays float64)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)


def token_divergence(student_logps: Tensor, teacher_logps: Tensor, beta: float) -> Tensor:
    r"""Element-wise (per vocabulary entry) generalised JSD terms of two log-distributions over the last dimension.

    With :math:`p_s, p_t` the student and teacher distributions and :math:`m = (1-\beta) p_s + \beta p_t`:

    .. math::
        D_\beta = \begin{cases}
            \mathrm{KL}(p_t \| p_s) & \beta = 0 \ \text{(forward KL)} \\
            \mathrm{KL}(p_s \| p_t) & \beta = 1 \ \text{(reverse KL)} \\
            \beta\, \mathrm{KL}(p_t \| m) + (1-\beta)\, \mathrm{KL}(p_s \| m) & \text{otherwise}
        \end{cases}

    Summing the result over the last dimension gives :math:`D_\beta` per position.
    """
    if beta == 0.0:
        return teacher_logps.exp() * (teacher_logps - student_logps)
    if beta == 1.0:
        return student_logps.exp() * (student_logps - teacher_logps)
    log_m = torch.logaddexp(student_logps + math.log1p(-beta), teacher_logps + math.log(beta))
    return beta * teacher_logps.exp() * (teacher_logps - log_m) + (1.0 - beta) * student_logps.exp() * (
        student_logps - log_m
    )


def generalized_jsd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: JSDReduction = "batchmean",
    num_items_in_batch: Tensor | int | None = None,
) -> Tensor:
    r"""The generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, eq. 1), as TRL 1.16 computes it.

    Both logits are divided by ``temperature`` and log-softmaxed (at least float32); per position and vocabulary entry
    the terms of :func:`token_divergence` (``beta`` 0 = forward KL(teacher || student), 1 = reverse KL(student ||
    teacher), in between the JSD against the mixture :math:`m = (1-\beta) p_s + \beta p_t`). Positions whose label is
    ``-100`` are dropped. Reduction (TRL's semantics, vocabulary always summed except for ``"none"``/``"mean"``):

    * ``num_items_in_batch`` given: :math:`\sum / N` (the token-exact normaliser of an accumulation window);
    * ``"batchmean"``: with ``labels`` the mean over the kept positions, :math:`\sum / \max(1, \#\{y \ne -100\})`;
      without labels the sum divided by the batch size (the first dimension), as ``F.kl_div``'s batchmean;
    * ``"sum"``: the sum; ``"mean"``: the mean over every kept element (positions x vocabulary);
    * ``"none"``: the element-wise terms, ``(N, V)`` with labels (kept positions), else the logits' shape.

    Args:
        student_logits: ``(..., V)`` student logits, aligned with ``labels`` (shift before calling).
        teacher_logits: ``(..., V)`` teacher logits, same shape.
        labels: ``(...)`` the tokens these positions predict; ``-100`` = not scored. None scores every position.
        beta: interpolation in [0, 1].
        temperature: divides both logits (> 0).
        reduction: ``"batchmean"`` (default), ``"sum"``, ``"mean"`` or ``"none"``.
        num_items_in_batch: normaliser for token-exact accumulation; overrides ``reduction``.

    Returns:
        A 0-dim tensor (``"none"``: the element-wise terms).

    Raises:
        ValueError: ``beta`` outside [0, 1], ``temperature <= 0``, an unknown ``reduction`` or mismatched shapes.
    """
    _check(beta, temperature, reduction)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ: "
            "the two models must share the vocabulary (and the rows)."
        )
    terms = token_divergence(_log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature), beta)
    mask = None
    if labels is not None:
        mask = labels != IGNORE_INDEX
        terms = terms[mask]
    if num_items_in_batch is not None:
        total = terms.sum()
        return total / torch.as_tensor(num_items_in_batch, device=total.device).clamp(min=1)
    if reduction == "batchmean":
        denominator = mask.sum().clamp(min=1) if mask is not None else max(terms.shape[0], 1)
        return terms.sum() / denominator
    return {"sum": torch.sum, "mean": torch.mean, "none": lambda t: t}[reduction](terms)


def _chunk_divergence(
    h_s: Tensor, w_s: Tensor, b_s: Tensor | None, h_t: Tensor, w_t: Tensor, b_t: Tensor | None, beta: float, t: float
) -> Tensor:
    student = _log_probs(F.linear(h_s, w_s, b_s), t)
    with torch.no_grad():
        teacher = _log_probs(F.linear(h_t, w_t, b_t), t)
    return token_divergence(student, teacher, beta).sum(-1)


def chunked_token_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """Per-position :math:`D_\\beta` (vocabulary summed) from the last hidden states, a chunk of positions at a time.

    Each chunk projects ``chunk_size`` student and teacher hidden states through their heads, takes the terms of
    :func:`token_divergence` at ``temperature`` and sums them over the vocabulary; the chunk runs under activation
    checkpointing, so the backward pass recomputes one chunk's logits at a time. The teacher side carries no gradient.
    Equal to ``generalized_jsd_loss(..., reduction="none").sum(-1)`` on the full logits, to float rounding.

    Args:
        student_hidden: ``(N, Hs)`` student hidden states of the scored positions.
        student_weight: ``(V, Hs)`` student output head.
        teacher_hidden: ``(N, Ht)`` teacher hidden states of the same positions (the widths may differ).
        teacher_weight: ``(V, Ht)`` teacher output head (same vocabulary).
        student_bias: ``(V,)`` student head bias, if any.
        teacher_bias: ``(V,)`` teacher head bias, if any.
        beta: interpolation in [0, 1].
        temperature: divides both logits (> 0).
        chunk_size: positions per chunk (default: about 64 MiB of float32 logits per model).

    Returns:
        ``(N,)`` per-position divergences, at least float32.

    Raises:
        ValueError: bad ``beta``/``temperature``/``chunk_size``, or shapes that do not fit (another vocabulary).
    """
    _check(beta, temperature)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"`chunk_size={chunk_size}` is invalid: use >= 1 positions, or None for the default.")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"The student head has {student_weight.shape[0]} outputs and the teacher head {teacher_weight.shape[0]}: "
            "distillation compares full next-token distributions, so the vocabularies must be the same."
        )
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(f"{student_hidden.shape[0]} student positions but {teacher_hidden.shape[0]} teacher ones.")
    size = chunk_size or max(16, _CHUNK_ELEMENTS // max(student_weight.shape[0], 1))
    parts = []
    for start in range(0, student_hidden.shape[0], size):
        stop = start + size
        args = (student_hidden[start:stop], student_weight, student_bias, teacher_hidden[start:stop], teacher_weight)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_divergence, *args, teacher_bias, beta, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_divergence(*args, teacher_bias, beta, temperature))
    if not parts:
        dtype = torch.promote_types(student_hidden.dtype, torch.float32)  # no position: zeros, still in the graph
        return (student_hidden.sum(-1) * 0.0).to(dtype) + 0.0 * student_weight.sum()
    return torch.cat(parts)
