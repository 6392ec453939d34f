"""Streaming evaluation metrics (torchmetrics): memory independent of the evaluation set size.

The HF Trainer concatenates every batch's logits before ``compute_metrics`` (docs/design.md#hf-eval-metrics); these
metrics are updated batch by batch and reduced across ranks once, in ``compute()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric, Metric

from lit_trainer.losses.logprobs import IGNORE_INDEX


class CausalLMEvalMetrics(torch.nn.Module):
    """Global per-token loss, perplexity and next-token accuracy, plus optional greedy exact match.

    ``loss`` is the token mean over the whole evaluation set (not the HF Trainer's sample-weighted mean of per-batch
    means), ``perplexity = exp(loss)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.loss = MeanMetric()
        self.token_accuracy = MeanMetric()
        self.exact_match = MeanMetric()

    @torch.no_grad()
    def update_from_logits(self, logits: Tensor, labels: Tensor) -> None:
        """Update loss and accuracy from ``(B, T, V)`` logits and unshifted labels."""
        shifted = logits[:, :-1].float()
        targets = labels[:, 1:]
        mask = targets != IGNORE_INDEX
        count = mask.sum()
        if int(count) == 0:
            return
        loss_sum = F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        correct = ((shifted.argmax(-1) == targets) & mask).sum()
        self.loss.update(loss_sum / count, weight=count)
        self.token_accuracy.update(correct / count, weight=count)

    def update_exact_match(self, matches: Tensor) -> None:
        """Update with a boolean tensor, one entry per evaluated prompt."""
        if matches.numel():
            self.exact_match.update(matches.float())

    def compute(self) -> dict[str, Tensor]:
        """``{"val_loss", "val_perplexity", "val_token_accuracy"[, "val_exact_match"]}`` reduced over ranks."""
        out: dict[str, Tensor] = {}
        if self.loss.update_called:
            loss = self.loss.compute()
            out.update(val_loss=loss, val_perplexity=torch.exp(loss), val_token_accuracy=self.token_accuracy.compute())
        if self.exact_match.update_called:
            out["val_exact_match"] = self.exact_match.compute()
        return out

    def reset(self) -> None:
        """Clear all states for the next evaluation."""
        metric: Metric
        for metric in (self.loss, self.token_accuracy, self.exact_match):
            metric.reset()


def greedy_exact_match(generated: Tensor, targets: Tensor, eos_token_id: int | None) -> Tensor:
    """Per-row exact match of generated completions against reference completions.

    Args:
        generated: ``(B, G)`` new tokens from ``generate`` (padded after EOS with the pad id).
        targets: ``(B, C)`` reference completion ids, ``-100`` padded; their EOS (if any) is not required in
            ``generated`` but nothing other than pad/EOS may follow the matched answer.
        eos_token_id: the EOS id ending a completion.

    Returns:
        ``(B,)`` bool.
    """
    results = []
    for gen, tgt in zip(generated.tolist(), targets.tolist()):
        tgt = [t for t in tgt if t != IGNORE_INDEX and t != eos_token_id]
        if eos_token_id is not None and eos_token_id in gen:
            gen = gen[: gen.index(eos_token_id)]
        else:
            gen = gen[: len(tgt) + 1]
        results.append(gen == tgt)
    return torch.tensor(results, dtype=torch.bool)
