"""The base of reference-free preference optimisation: :class:`~lit_trainer.modules.orpo.ORPOModule` (ORPO, in
``orpo.py``) and :class:`~lit_trainer.modules.cpo.CPOModule` (CPO, SimPO, AlphaPO, in ``cpo.py``), with TRL 1.16's
experimental ``ORPOTrainer``/``CPOTrainer`` numerics and no reference model at all (both classes are exported by
:mod:`lit_trainer` too).

Both train on :class:`~lit_trainer.data.PreferenceDataModule` pairs exactly as
:class:`~lit_trainer.modules.dpo.DPOModule` does (one forward of the 2B chosen-then-rejected rows scored by
:func:`~lit_trainer.modules.scoring.score_rows`, chunked per-token log-probs, padding-free batches, images, LoRA,
FSDP2: the :class:`~lit_trainer.modules.preference.PreferenceModule` base they share with DPO and KTO) and
share one private base here: the loss is a PAIR term (summed over the micro-batch, divided by the optimizer
step's pair count) plus a weighted NLL term on the chosen rows (summed, divided by the step's count of those tokens),
so gradient accumulation and DDP give the full-batch loss of the step. The pure losses are in
:mod:`lit_trainer.losses.reference_free`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lit_trainer.data.vision.collate import image_inputs
from lit_trainer.modules.dpo import METRIC_NAMES as DPO_METRIC_NAMES
from lit_trainer.modules.preference import PreferenceModule
from lit_trainer.modules.scoring import RowScores

__all__ = ["CPO_METRIC_NAMES", "ORPO_METRIC_NAMES"]

#: TRL's metric names, logged per training window (and with a ``val_`` prefix in validation)
CPO_METRIC_NAMES = (*DPO_METRIC_NAMES, "nll_loss")  # DPO's names, computed from the policy alone
ORPO_METRIC_NAMES = (*CPO_METRIC_NAMES, "log_odds_ratio", "log_odds_chosen")


class _ReferenceFreeModule(PreferenceModule):
    """The shared base: scoring, the two-term loss and its token-exact normalisation, metrics, validation.

    A subclass sets :attr:`averaged`, :attr:`nll_on_prompt` and :attr:`nll_weight` and writes :meth:`pair_terms` and
    :meth:`pair_metrics`. There is no ``ref_model``: nothing but the policy is loaded or held. The rows are scored
    as DPO's (:func:`~lit_trainer.modules.scoring.score_rows`, the chosen NLL of
    :meth:`~lit_trainer.modules.preference.PreferenceModule.chosen_nll`); only the targets differ (ORPO's NLL
    also scores the prompt tokens) and the pair term may average instead of sum.
    """

    #: the pair term takes per-token AVERAGED log-probs (else sums)
    averaged: bool = True
    #: the NLL term covers the chosen rows' prompt tokens too (ORPO in TRL), else their completion tokens only
    nll_on_prompt: bool = False
    #: the weight of the NLL term (0: not computed into the loss)
    nll_weight: float = 1.0
    #: no reference model (``BaseModule.networks_to_shard`` and the callbacks duck-type on this attribute)
    ref_model = None
    metric_names: tuple[str, ...] = CPO_METRIC_NAMES

    # ------------------------------------------------------------------------------------------ subclass API
    def pair_terms(self, chosen: Tensor, rejected: Tensor) -> Tensor:
        """``(B,)`` per-pair losses from the pair term's per-sequence log-probs."""
        raise NotImplementedError

    def pair_metrics(self, chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
        """The reward metrics (TRL's ``rewards/*`` and, for ORPO, the log-odds) of one micro-batch."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ scoring
    @override
    def scoring_options(self) -> dict[str, Any]:
        """The NLL term's targets (``"all"`` when it covers the prompt) and the pair term's averaging."""
        return {"targets": "all" if self.nll_on_prompt else "completion", "averaged": self.averaged}

    @override
    def score(self, model: torch.nn.Module, batch: dict[str, Tensor], stats: bool = False) -> RowScores:
        """Per-token log-probs of the 2B rows (over the NLL term's tokens), the pair term's per-sequence log-probs
        (sum or average over the completion tokens) and the completion mask, from one forward
        (:meth:`~lit_trainer.modules.preference.PreferenceModule.score_rows`). A batch with images gives the policy
        its image inputs.

        Raises:
            ValueError: a batch with images when the NLL term covers the prompt (ORPO): it would score the image
                placeholder tokens as text.
        """
        if self.nll_on_prompt and image_inputs(batch):
            raise ValueError(
                f"{type(self).__name__} does not take preference rows with images: its NLL term covers the prompt, "
                "so it would score the image placeholder tokens as text. Train CPOModule or DPOModule on them (they "
                "pass the images to the model), or drop the image column."
            )
        return self.score_rows(model, batch, stats=stats)

    # ------------------------------------------------------------------------------------------ loss
    def _pair_losses(self, scored: RowScores) -> Tensor:
        seq = scored.seq
        pairs = seq.numel() // 2
        return self.pair_terms(seq[:pairs], seq[pairs:])

    def _nll_count(self, counts: Tensor | None, local: Tensor) -> Tensor:
        if counts is None:
            return local
        index = 2 if self.nll_on_prompt else 1
        counts = counts.reshape(-1)
        if counts.numel() <= index:
            what = "pairs, chosen completion tokens" + (", chosen tokens with their prompt" if index == 2 else "")
            raise ValueError(
                f"{type(self).__name__} needs {index + 1} counts per micro-batch in `num_items_in_batch` ({what}): "
                "train with a PreferenceDataModule, or make your loader's `count_items` return them (see "
                "`PreferenceDataModule.count_items`)."
            )
        return counts[index]

    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``Σ pair terms / step pairs + w · Σ chosen NLL / step NLL tokens`` (step counts over micro-batches and
        ranks when given; the micro-batch's own counts otherwise, which is TRL's loss)."""
        scored = self.score(self.model, batch, stats=True)
        losses = self._pair_losses(scored)
        pairs = losses.numel() if num_items_in_batch is None else num_items_in_batch.reshape(-1)[0]
        loss = losses.sum() / pairs
        nll, tokens = self.chosen_nll(scored)
        if self.nll_weight:
            loss = loss + self.nll_weight * nll / self._nll_count(num_items_in_batch, tokens).clamp(min=1)
        return loss, self._metrics_of(scored, nll.detach() / tokens.clamp(min=1))

    def _metrics_of(self, scored: RowScores, nll: Tensor) -> dict[str, Tensor]:
        seq = scored.seq.detach()
        pairs = seq.numel() // 2
        with torch.no_grad():
            metrics = self.pair_metrics(seq[:pairs], seq[pairs:])
            metrics["logps/chosen"], metrics["logps/rejected"] = seq[:pairs].mean(), seq[pairs:].mean()
            metrics.update(self.logits_metrics(scored, slice(None, pairs), slice(pairs, None)))
            metrics["nll_loss"] = nll
        return metrics

    # ------------------------------------------------------------------------------------------ Lightning hooks
    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        scored = self.score(self.model, batch, stats=True)
        losses = self._pair_losses(scored)
        nll, tokens = self.chosen_nll(scored)
        self.val_metrics["loss"].update(losses.mean(), weight=losses.numel())
        for name, value in self._metrics_of(scored, nll / tokens.clamp(min=1)).items():
            self.val_metrics[name].update(value, weight=tokens if name == "nll_loss" else losses.numel())

    @override
    def finalize_val_metrics(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """``val_loss`` = the set's mean pair term + ``w`` × its token-mean NLL (``val_nll_loss``, also logged)."""
        if "val_loss" in values and "val_nll_loss" in values and self.nll_weight:
            values["val_loss"] = values["val_loss"] + self.nll_weight * values["val_nll_loss"]
        return values
