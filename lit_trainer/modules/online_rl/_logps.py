"""The per-token log-probs of rollout rows: one forward, run by the trainer (old, reference and sampler-check
log-probs, the loss) and by the asynchronous rollout worker (the behaviour log-probs of the rounds it samples).

:func:`completion_logps` is the forward, :func:`chunked_logps` runs it over a round in chunks of one micro-batch, and
:class:`CompletionScorer` is the forward as a picklable object: what
:meth:`~lit_trainer.modules.grpo.GRPOModule.behaviour_scorer` gives the worker by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lit_trainer.data.vision import prompt as vision_prompt
from lit_trainer.losses.logprobs import IGNORE_INDEX
from lit_trainer.modules.base import _logits
from lit_trainer.modules.base._logits import ChunkedLogits, TokenScores
from lit_trainer.modules.online_rl._rollout_buffer import ATTENTION

#: ``(model, rows) -> (B, C)`` per-token log-probs of the rows' completion tokens
Logps = Callable[[Any, dict[str, Tensor]], Tensor]


def completion_logps(
    score_tokens: Callable[..., TokenScores],
    model: Any,
    rows: dict[str, Tensor],
    *,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (B, C) of the completion tokens under ``model``, logits divided by ``temperature``, and
    the entropy when asked (with gradient only when ``entropy_grad``).

    The input is ``[left-padded prompt ; right-padded completion]`` with position ids from the attention mask (as
    ``generate`` uses), so the log-probs match the sampling distribution. Rows of prompts with images carry their
    image inputs (:mod:`lit_trainer.data.vision.prompt`), passed to the model with the ids. ``score_tokens``: the
    module's :meth:`~lit_trainer.modules.base.BaseModule.score_tokens`, or :func:`_logits.score_tokens` with its
    chunking bound (:class:`CompletionScorer`).
    """
    completion = rows["completion_ids"]
    ids = torch.cat([rows["prompt_ids"], completion], dim=1)
    attention = torch.cat([rows["prompt_mask"], rows.get(ATTENTION, rows["completion_mask"])], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    # the last C + 1 positions: position i predicts completion token i, the last one nothing
    targets = torch.cat([completion, completion.new_full((completion.shape[0], 1), IGNORE_INDEX)], dim=1)
    scores = score_tokens(
        model,
        targets,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=False,
        **vision_prompt.model_image_inputs(rows, completion.shape[1]),  # prompts with images: the same images
    )
    logps = scores.logps[:, :-1]
    if not with_entropy:
        return logps, None
    return logps, scores.entropy[:, :-1]


def chunked_logps(logps: Logps, model: Any, rows: dict[str, Tensor], size: int) -> Tensor:
    """``logps`` of the rows in chunks of ``size`` rows (a micro-batch), concatenated; no grad is asked."""
    keys = [k for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", ATTENTION) if k in rows]
    keys += vision_prompt.row_image_keys(rows)
    count = rows["prompt_ids"].shape[0]
    return torch.cat([logps(model, {k: rows[k][i : i + size] for k in keys}) for i in range(0, count, size)])


@dataclass(frozen=True)
class CompletionScorer:
    """:func:`completion_logps` as a picklable ``(model, rows) -> log-probs`` (no entropy): the temperature and the
    module's ``chunked_logits`` / ``logits_chunk_size``, applied as
    :meth:`~lit_trainer.modules.base.BaseModule.score_tokens` applies them."""

    temperature: float
    chunked_logits: ChunkedLogits = "auto"
    logits_chunk_size: int | None = None

    def __call__(self, model: Any, rows: dict[str, Tensor]) -> Tensor:
        chunked = _logits.wants_chunked(model, self.chunked_logits)
        score = partial(_logits.score_tokens, chunked=chunked, chunk_size=self.logits_chunk_size)
        return completion_logps(score, model, rows, temperature=self.temperature)[0]
