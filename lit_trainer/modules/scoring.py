"""One scoring function for batches of (prompt, completion) rows: :func:`score_rows` and its result,
:class:`RowScores`.

Every preference module (DPO and its variants, ORPO, CPO/SimPO, KTO) and the reference precompute pass score their
rows here: one forward of the rows (text, or text with images), chunked or full logits as the module's
``chunked_logits`` says (:meth:`~lit_trainer.modules.base.BaseModule.score_tokens`), packed or padded batches. What
the losses differ in is a few arguments: which tokens are targets (the completion, or every real token for ORPO's
NLL term), whether the per-sequence log-prob is a sum, an LD-DPO weighted sum or a per-token average, and which
columns hold the rows (KTO's mismatched ``KL_*`` rows). The per-sequence sum is
:func:`lit_trainer.losses.dpo.sequence_logps` everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from lit_trainer.data.packing import row_completion_mask
from lit_trainer.data.vision.collate import image_inputs
from lit_trainer.losses.dpo import sequence_logps
from lit_trainer.losses.logprobs import IGNORE_INDEX
from lit_trainer.modules.base._logits import TokenScores, next_token_targets
from lit_trainer.modules.base._packing import masking_kwargs, per_row

__all__ = ["RowScores", "score_rows"]

#: the columns of one set of rows (a prefix such as KTO's ``"KL_"`` selects another set)
_ROW_KEYS = ("input_ids", "attention_mask", "completion_mask", "position_ids", "seq_lengths")


class RowScores(NamedTuple):
    """One forward of N rows, all ``(N, T-1)`` per shifted position except :attr:`seq` ``(N,)``.

    Attributes:
        seq: per-sequence log-prob of each row's completion: the sum (LD-DPO weighted when asked), or the per-token
            average when ``averaged``.
        token_logps: per-token log-probs of the targets (0 where a position is not a target).
        mask: the targets (the completion tokens, or every real token with ``targets="all"``).
        logits_mean: the vocabulary-mean logit per position (detached), or None when ``stats`` was False.
        completion: the completion tokens (what :attr:`seq` sums over; equal to :attr:`mask` unless
            ``targets="all"``).
    """

    seq: Tensor
    token_logps: Tensor
    mask: Tensor
    logits_mean: Tensor | None
    completion: Tensor

    @property
    def tokens(self) -> Tensor:
        """``(N,)`` completion token count of each row."""
        return self.completion.sum(-1)


def score_rows(
    score_tokens: Callable[..., TokenScores],
    model: Any,
    batch: dict[str, Any],
    *,
    prefix: str = "",
    targets: Literal["completion", "all"] = "completion",
    averaged: bool = False,
    ld_alpha: float | None = None,
    stats: bool = False,
) -> RowScores:
    """Score the completions of the rows of ``batch`` under ``model`` in one forward.

    Args:
        score_tokens: the module's :meth:`~lit_trainer.modules.base.BaseModule.score_tokens` (it picks chunked or
            full logits for ``model``), or :func:`~lit_trainer.modules.base._logits.score_tokens` with ``chunked``
            bound.
        model: the causal LM (the policy or the reference).
        batch: ``input_ids``, ``completion_mask`` and ``attention_mask`` (padded) or ``position_ids`` and
            ``seq_lengths`` (packed); image columns, when present, go to the model too
            (:func:`~lit_trainer.data.vision.collate.image_inputs`). Packed rows are split back per row.
        prefix: read the rows from ``<prefix>input_ids`` etc. (KTO's ``"KL_"`` partner rows; no images there).
        targets: ``"completion"``: the completion tokens are the targets; ``"all"``: every real token (ORPO's NLL
            term covers the prompt); :attr:`RowScores.seq` sums over the completion either way.
        averaged: :attr:`RowScores.seq` is the per-token average over the completion (sum / tokens).
        ld_alpha: LD-DPO's weight of the tokens past the shorter completion of a pair (rows ``0..B-1`` chosen,
            ``B..2B-1`` rejected); None: a plain sum.
        stats: also the vocabulary-mean logits.

    Example:
        A two-token completion ``[5, 6]`` after the prompt ``[3]`` is scored at positions 0 and 1 (each position
        predicts the next token): ``seq = log p(5 | 3) + log p(6 | 3, 5)``.
    """
    rows = {key: batch[prefix + key] for key in _ROW_KEYS if prefix + key in batch}
    images = image_inputs(batch) if not prefix else {}
    if targets == "all":  # every real token is a target; a packed row's boundaries are dropped by `per_row`
        keep = rows["attention_mask"] if "attention_mask" in rows else torch.ones_like(rows["input_ids"])
    else:
        keep = rows["completion_mask"]
    shifted = next_token_targets(rows["input_ids"].masked_fill(keep == 0, IGNORE_INDEX))
    scores = score_tokens(
        model,
        shifted,
        with_logits_mean=stats,
        input_ids=rows["input_ids"],
        use_cache=False,
        **masking_kwargs(rows),
        **images,
    )
    token_logps, mask = scores.logps[:, :-1], shifted[:, :-1] != IGNORE_INDEX
    logits_mean = scores.logits_mean[:, :-1] if stats else None
    token_logps, mask, logits_mean = per_row(rows, token_logps, mask, logits_mean)  # a packed batch: (N, .)
    completion = mask if targets == "completion" else row_completion_mask(rows)[:, 1:].bool() & mask
    seq = sequence_logps(token_logps, completion, ld_alpha)
    if averaged:  # TRL's average_log_prob: sum / completion tokens
        seq = seq / completion.sum(-1).clamp(min=1)
    return RowScores(seq, token_logps, mask, logits_mean, completion)
