"""Per-token scores of a causal LM without its full logits, for every module's loss and validation.

:func:`score_tokens` runs the model once and returns, for the positions asked, the log-probability of each position's
target token and optionally its entropy, its vocabulary-mean logit and whether the argmax hits the target. With
``chunked=True`` it swaps the output head's ``forward`` for the duration of the call: the head then receives the last
hidden states and returns these few numbers per position instead of ``B x T x V`` logits, computed a chunk of tokens
at a time (:func:`lit_trainer.losses.chunked.chunked_token_logps`; in backward one chunk's logits are recomputed at a
time). The swap happens inside the model's own forward, so FSDP2 has gathered the head's weight as for the normal
path, LoRA adapters on the body apply, and gradient checkpointing is unchanged.

Whether a model can take the chunked path is checked once per model (:func:`supports_chunked`): the head must be a
plain ``nn.Linear`` and a tiny probe must give the same log-probabilities both ways (a model that scales or caps its
logits after the head, e.g. Gemma 2's soft-capping, fails the probe and keeps the full path).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Literal, NamedTuple
from weakref import WeakKeyDictionary

import torch
from torch import Tensor

from lit_trainer.losses.chunked import chunked_logp_sum, chunked_token_logps, default_chunk_size
from lit_trainer.losses.logprobs import IGNORE_INDEX, selective_log_softmax

ChunkedLogits = Literal["auto", "on", "off"]
"""``"auto"``: chunked when the vocabulary has at least :data:`AUTO_VOCAB` tokens and the model supports it."""
AUTO_VOCAB = 32_000  # every current LLM vocabulary; the presets' 384 keep the full path
_SUPPORTED: WeakKeyDictionary[torch.nn.Module, bool] = WeakKeyDictionary()


class TokenScores(NamedTuple):
    """Per-position results of :func:`score_tokens`, each ``(B, K)`` (None when not asked)."""

    logps: Tensor  # log p(target); 0 where the target is -100
    entropy: Tensor | None
    logits_mean: Tensor | None  # mean logit over the vocabulary (detached)
    hits: Tensor | None  # argmax == target (bool; False where ignored)


def next_token_targets(labels: Tensor) -> Tensor:
    """``(B, T)`` targets of every position from unshifted labels: ``labels[:, t + 1]``, the last position -100."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def output_head(model: Any) -> Any:
    """The model's output projection (through PEFT and Lightning wrappers)."""
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if getter is not None else None


def wants_chunked(model: Any, setting: ChunkedLogits) -> bool:
    """Whether ``setting`` asks for the chunked path on ``model`` ("on" raises if the model cannot take it)."""
    if setting == "off":
        return False
    head = output_head(model)
    if setting == "auto" and (head is None or getattr(head, "out_features", 0) < AUTO_VOCAB):
        return False
    if supports_chunked(model):
        return True
    if setting == "on":
        raise ValueError(
            f"`chunked_logits='on'` needs a model whose output head is a plain nn.Linear used as is (got "
            f"{type(head).__name__}, or logits changed after the head): use 'auto' or 'off' for this model."
        )
    return False


@torch.no_grad()
def supports_chunked(model: Any) -> bool:
    """A plain ``nn.Linear`` head, and the chunked log-probs of a 4-token probe equal the full path's (cached)."""
    if model in _SUPPORTED:
        return _SUPPORTED[model]
    head = output_head(model)
    ok = type(head) is torch.nn.Linear
    if ok:  # in eval mode: no dropout (the two forwards must see the same network) and no RNG drawn
        ids = torch.tensor([[1, 2, 3, 4]], device=head.weight.device) % head.out_features
        targets, training = ids.roll(-1, 1), model.training
        model.eval()
        try:
            full = score_tokens(model, targets, chunked=False, input_ids=ids, use_cache=False).logps
            chunked = score_tokens(model, targets, chunked=True, input_ids=ids, use_cache=False).logps
        finally:
            model.train(training)
        # 1e-4: far above float32 rounding of 4 log-probs (~1e-6), far below what a scaled or capped logit changes
        ok = bool(torch.allclose(full, chunked, rtol=1e-4, atol=1e-4))
    _SUPPORTED[model] = ok
    return ok


@contextmanager
def _head_forward(head: torch.nn.Module, forward: Any):
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def score_tokens(
    model: Any,
    targets: Tensor,
    *,
    chunked: bool,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    with_logits_mean: bool = False,
    with_hits: bool = False,
    chunk_size: int | None = None,
    **forward_kwargs: Any,
) -> TokenScores:
    """Run ``model(**forward_kwargs)`` and score the last ``K = targets.shape[1]`` positions.

    Args:
        model: a causal LM (``logits_to_keep`` is passed when ``K`` is shorter than the input).
        targets: ``(B, K)`` the token each of the last ``K`` positions predicts; ``-100`` = not scored.
        chunked: compute from the hidden states a chunk at a time (see the module docstring) instead of full logits.
        temperature: logits are divided by it (GRPO's sampling temperature).
        with_entropy: also the entropy per position.
        entropy_grad: the entropy carries a gradient (when grad is enabled); False: it is a measurement only.
        with_logits_mean: also the vocabulary-mean logit per position (no grad).
        with_hits: also whether the argmax is the target (no grad).
        chunk_size: tokens per chunk (default: about 64 MiB of float32 logits).
        **forward_kwargs: the model inputs (``input_ids``, ``attention_mask``, ``position_ids``, ``use_cache``...).
    """
    length = forward_kwargs["input_ids"].shape[1]
    keep = targets.shape[1]
    if keep < length:
        forward_kwargs["logits_to_keep"] = keep
    valid = targets != IGNORE_INDEX
    safe = targets.masked_fill(~valid, 0)
    if not chunked:
        logits = model(**forward_kwargs).logits[:, -keep:]
        logps = selective_log_softmax(logits, safe, temperature)
        entropy = mean = hits = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                z = logits.float() / temperature
                entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        if with_logits_mean:
            mean = logits.detach().mean(-1).float()
        if with_hits:
            hits = (logits.detach().argmax(-1) == targets) & valid
        return TokenScores(logps.masked_fill(~valid, 0.0), entropy, mean, hits)

    head = output_head(model)
    fields: dict[str, Tensor | None] = {}

    def forward(hidden: Tensor) -> Tensor:
        weight, bias = head.weight, head.bias
        size = chunk_size or default_chunk_size(weight.shape[0])
        logps, entropy = chunked_token_logps(
            hidden, weight, safe, bias=bias, temperature=temperature, chunk_size=size, with_entropy=with_entropy
        )
        fields["logps"] = logps
        fields["entropy"] = entropy if entropy is None or entropy_grad else entropy.detach()
        if with_logits_mean or with_hits:
            with torch.no_grad():
                if with_logits_mean:
                    mean_row = weight.float().mean(0)
                    fields["mean"] = hidden.float() @ mean_row + (bias.float().mean() if bias is not None else 0.0)
                if with_hits:
                    flat = hidden.reshape(-1, hidden.shape[-1])
                    best = [torch.nn.functional.linear(h, weight, bias).argmax(-1) for h in flat.split(size)]
                    fields["hits"] = (torch.cat(best).reshape(safe.shape) == targets) & valid
        return logps.unsqueeze(-1)  # a (B, K, 1) stand-in for the logits the model returns

    with _head_forward(head, forward):
        model(**forward_kwargs)
    return TokenScores(
        fields["logps"].masked_fill(~valid, 0.0), fields.get("entropy"), fields.get("mean"), fields.get("hits")
    )


def summed_logps(model: Any, targets: Tensor, *, chunk_size: int | None = None, **forward_kwargs: Any) -> Tensor:
    """``sum`` of the log-probabilities of ``targets`` (``-100`` = not counted) through the chunked head, with the
    gradients formed in the forward pass (:func:`~lit_trainer.losses.chunked.chunked_logp_sum`): the SFT loss's sum."""
    length, keep = forward_kwargs["input_ids"].shape[1], targets.shape[1]
    if keep < length:
        forward_kwargs["logits_to_keep"] = keep
    valid = targets != IGNORE_INDEX
    head, result = output_head(model), {}

    def forward(hidden: Tensor) -> Tensor:
        weight = head.weight
        size = chunk_size or default_chunk_size(weight.shape[0])
        weights = valid.to(hidden.dtype)
        result["sum"] = chunked_logp_sum(
            hidden, weight, targets.masked_fill(~valid, 0), weights, bias=head.bias, chunk_size=size
        )
        return result["sum"].reshape(1, 1, 1).expand(*targets.shape, 1)  # a stand-in for the logits

    with _head_forward(head, forward):
        model(**forward_kwargs)
    return result["sum"]
