"""The scoring mixin of :class:`~lit_trainer.modules.dpo.DPOModule`: per-sequence completion log-probs of the 2B rows
of a preference batch under the policy or the reference (or the batch's precomputed reference log-probs), the pair
terms and the ``sft`` term of the loss, and the logged reward/log-prob/logit metrics."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_trainer.data.packing import row_completion_mask
from lit_trainer.data.preference.collate import REF_CHOSEN_KEY, REF_REJECTED_KEY
from lit_trainer.losses.dpo import dpo_loss, dpo_rewards_metrics
from lit_trainer.modules.scoring import RowScores, score_rows

Scores = RowScores
"""One forward of 2B rows (:class:`~lit_trainer.modules.scoring.RowScores`): per-sequence sums, shifted per-token
log-probs and mask, vocabulary-mean logits."""


class DPOScoringMixin:
    """Scoring and loss terms of :class:`~lit_trainer.modules.dpo.DPOModule` (reads ``self.loss_types``,
    ``self.loss_weights``, ``self._loss_options``, ``self.sft_weight``, ``self.ref_model`` and the hyperparameters)."""

    def score(self, model: torch.nn.Module, batch: dict[str, Tensor], stats: bool = False) -> Scores:
        """Per-sequence completion log-probs of the 2B rows of ``batch`` under ``model`` (LD-weighted if set). A batch
        with images gives ``model`` its image inputs too (:func:`~lit_trainer.data.vision.collate.image_inputs`): the
        policy and the reference see the same images (:func:`~lit_trainer.modules.scoring.score_rows`)."""
        return score_rows(self.score_tokens, model, batch, ld_alpha=self.hparams.ld_alpha, stats=stats)

    def _reference_logps(self, batch: dict[str, Tensor]) -> Tensor:
        if REF_CHOSEN_KEY in batch:
            return torch.cat([batch[REF_CHOSEN_KEY], batch[REF_REJECTED_KEY]]).to(self.device, torch.float32)
        if self.ref_model is None:
            raise ValueError(
                "This batch carries no `ref_chosen_logps`/`ref_rejected_logps` and the reference model "
                "has been released (precompute_ref_log_probs=True): feed batches from the "
                "PreferenceDataModule the log-probs were precomputed for."
            )
        with torch.no_grad():
            return self.score(self.ref_model, batch).seq

    def pair_losses(self, scores: Scores, ref: Tensor, completion_mask: Tensor) -> Tensor:
        """``(B,)`` per-pair ``Σ_k w_k ℓ^{(k)}`` over the pair loss types (the token-level ``sft`` term excluded)."""
        pairs, pi = ref.numel() // 2, scores.seq
        lengths = completion_mask.sum(-1)  # unshifted completion token counts (ipo, sigmoid_norm)
        total = pi.new_zeros(pairs)
        for name, weight in zip(self.loss_types, self.loss_weights):
            if name != "sft":
                term = dpo_loss(
                    pi[:pairs],
                    pi[pairs:],
                    ref[:pairs],
                    ref[pairs:],
                    loss_type=name,
                    chosen_lengths=lengths[:pairs],
                    rejected_lengths=lengths[pairs:],
                    **self._loss_options,
                )
                total = total + weight * term
        return total

    @staticmethod
    def chosen_nll(scores: Scores) -> tuple[Tensor, Tensor]:
        """Summed negative log-likelihood of the chosen completion tokens, and their count (the ``sft`` term)."""
        pairs = scores.seq.numel() // 2
        return -scores.token_logps[:pairs].sum(), scores.mask[:pairs].sum()

    def _total_loss(self, scores: Scores, ref: Tensor, batch: dict[str, Any], counts: Tensor | None) -> Tensor:
        """Pair terms / pairs + w_sft · chosen NLL / chosen tokens, with the step's global counts when given."""
        losses, (nll, tokens) = self.pair_losses(scores, ref, row_completion_mask(batch)), self.chosen_nll(scores)
        pairs = losses.numel() if counts is None else counts.reshape(-1)[0]
        if counts is not None and self.sft_weight:
            if counts.numel() < 2:
                raise ValueError(
                    "DPOModule(loss_type=[..., 'sft']) needs two counts per micro-batch (pairs, chosen "
                    "completion tokens) in `num_items_in_batch`: train with a PreferenceDataModule, or "
                    "make your loader's `count_items` return both."
                )
            tokens = counts.reshape(-1)[1]
        return losses.sum() / pairs + self.sft_weight * nll / tokens.clamp(min=1)

    def _metrics(self, scores: Scores, ref: Tensor) -> dict[str, Tensor]:
        pairs, pi = ref.numel() // 2, scores.seq
        metrics = dpo_rewards_metrics(pi[:pairs], pi[pairs:], ref[:pairs], ref[pairs:], self._loss_options["beta"])
        mask = scores.mask.float()
        weighted = scores.logits_mean * mask
        metrics["logits/chosen"] = weighted[:pairs].sum() / mask[:pairs].sum().clamp(min=1)
        metrics["logits/rejected"] = weighted[pairs:].sum() / mask[pairs:].sum().clamp(min=1)
        return metrics
