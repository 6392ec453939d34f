"""The bases of the preference modules: :class:`PreferenceModule` (DPO, KTO, ORPO, CPO) and
:class:`ReferencePreferenceModule` (DPO and KTO, which compare the policy with a reference model).

What every preference module shares is here: dropout disabled in the policy (TRL's default), the validation metrics
registered from :attr:`PreferenceModule.metric_names`, the policy's ``forward``, batch scoring through
:func:`~lit_trainer.modules.scoring.score_rows` (:meth:`PreferenceModule.score_rows`, with the module's own
:meth:`~PreferenceModule.scoring_options`), the chosen rows' NLL and the per-side logit metrics, and the packing check
at setup. :class:`ReferencePreferenceModule` adds the reference model, held as one
:class:`~lit_trainer.modules.reference.ReferenceModel` (``self.reference``; the network is ``self.ref_model``), and
the Lightning hooks that drive it (TR-DPO after the optimizer step, the precompute pass at fit start, eval mode, the
strategy checks, checkpoints). Each concrete module declares only its own options and loss.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import PreTrainedModel
from typing_extensions import Self, override

from lit_trainer.modules.base import BaseModule
from lit_trainer.modules.base._packing import check_trainer_packing
from lit_trainer.modules.base._ref_sync import ReferenceSyncMixin
from lit_trainer.modules.reference import ReferenceModel, _ref_logps, disable_dropout_in_model
from lit_trainer.modules.scoring import RowScores, score_rows

__all__ = ["PreferenceModule", "ReferencePreferenceModule"]


class PreferenceModule(BaseModule):
    """The shared base of DPO, KTO, ORPO and CPO: scoring, metric plumbing, dropout and the setup checks.

    A subclass sets :attr:`metric_names`, may override :meth:`scoring_options`, and writes ``compute_loss``,
    ``validation_step`` and ``finalize_val_metrics`` for its loss.

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel`` (the policy).
        disable_dropout: zero every dropout of the policy (TRL's default).
        learning_rate: peak learning rate.
        trust_remote_code: passed to ``from_pretrained``.
        **kwargs: optimizer, scheduler, LoRA, sharding and chunking options of
            :class:`~lit_trainer.modules.base.BaseModule`.
    """

    #: the validation metrics registered at construction, besides ``loss`` (logged with a ``val_`` prefix)
    metric_names: tuple[str, ...] = ()
    #: the data module whose batches the module trains on (named in error messages)
    data_module: str = "PreferenceDataModule"

    def __init__(
        self,
        model: str | PreTrainedModel,
        *,
        disable_dropout: bool,
        learning_rate: float,
        trust_remote_code: bool,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, learning_rate=learning_rate, trust_remote_code=trust_remote_code, **kwargs)
        if disable_dropout:
            disable_dropout_in_model(self.model)
        for name in ("loss", *self.metric_names):
            self.val_metrics.add(name, MeanMetric())

    # ------------------------------------------------------------------------------------------------- scoring
    def scoring_options(self) -> dict[str, Any]:
        """The module's keyword arguments of :func:`~lit_trainer.modules.scoring.score_rows` (``targets``,
        ``averaged``, ``ld_alpha``); none by default."""
        return {}

    def score_rows(self, model: Any, batch: dict[str, Tensor], prefix: str = "", stats: bool = False) -> RowScores:
        """Per-sequence completion log-probs of the rows ``<prefix>input_ids`` of ``batch`` under ``model``, one
        forward (:func:`~lit_trainer.modules.scoring.score_rows` with :meth:`scoring_options`). A batch with images
        gives ``model`` its image inputs too, so the policy and the reference see the same images."""
        return score_rows(self.score_tokens, model, batch, prefix=prefix, stats=stats, **self.scoring_options())

    def score(self, model: Any, batch: dict[str, Tensor], stats: bool = False) -> RowScores:
        """Every row of ``batch`` scored under ``model`` (what the loss and the reference precompute pass call)."""
        return self.score_rows(model, batch, stats=stats)

    @staticmethod
    def chosen_nll(scores: RowScores) -> tuple[Tensor, Tensor]:
        """Summed negative log-likelihood of the chosen rows' target tokens (rows ``0..B-1`` of the 2B), and their
        count (DPO's ``sft`` term, ORPO's and CPO's NLL term)."""
        pairs = scores.seq.numel() // 2
        return -scores.token_logps[:pairs].sum(), scores.mask[:pairs].sum()

    @staticmethod
    def logits_metrics(scores: RowScores, chosen: Any, rejected: Any) -> dict[str, Tensor]:
        """``logits/chosen`` and ``logits/rejected``: the vocabulary-mean logit averaged over the completion tokens of
        the ``chosen`` and ``rejected`` rows (a slice or a boolean row mask each)."""
        mask = scores.completion.float()
        weighted = scores.logits_mean * mask
        return {
            f"logits/{side}": weighted[rows].sum() / mask[rows].sum().clamp(min=1)
            for side, rows in (("chosen", chosen), ("rejected", rejected))
        }

    # ------------------------------------------------------------------------------------------ Lightning hooks
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Any:
        """Run the policy (logits only; the loss is computed by the module)."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            check_trainer_packing(self.trainer, self.model, getattr(self, "ref_model", None))


class ReferencePreferenceModule(ReferenceSyncMixin, PreferenceModule):
    """A :class:`PreferenceModule` with a reference model (DPO, KTO): ``self.reference``, a
    :class:`~lit_trainer.modules.reference.ReferenceModel` that a subclass sets up with :meth:`hold_reference` in its
    ``__init__``; the network is ``self.ref_model`` (eval mode, no gradients, not in the optimizer nor in clipping,
    saved in checkpoints as ``ref_model.*``, never trained).

    The hooks here drive it: TR-DPO after every optimizer step (``sync_reference_model``), the precompute pass at fit
    start (and before a ``validate`` run, keeping the network), eval mode after ``train()``, the strategy checks at
    setup (one device, DDP or ``ModelParallelStrategy``) and the precomputed log-probs in checkpoints.

    A new preference method with a reference model subclasses it: its ``__init__`` takes its own options, calls
    ``super().__init__(model, disable_dropout=..., learning_rate=..., trust_remote_code=..., **kwargs)`` and then
    :meth:`hold_reference`, and it writes ``compute_loss`` and ``validation_step``, reading the reference's log-probs
    with ``self.reference.logps(batch, columns, score)``.
    """

    #: under peft with ``adapter_path``: load that adapter a second time as the frozen reference adapter
    uses_reference_adapter = True
    reference: ReferenceModel

    def hold_reference(
        self,
        reference: Any,
        *,
        sync: tuple[bool, float, int],
        precompute: tuple[bool, int | None, str | None],
        disable_dropout: bool,
        trust_remote_code: bool,
        ld_alpha: float | None = None,
    ) -> None:
        """Set up ``self.reference`` and build ``self.ref_model`` from the ``ref_model`` option.

        Args:
            reference: the ``ref_model`` option (None, a name/path, or a model object).
            sync: ``(sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps)``.
            precompute: ``(precompute_ref_log_probs, precompute_ref_batch_size, ref_logps_cache_dir)``.
            disable_dropout: zero every dropout of the reference network too.
            trust_remote_code: passed to ``from_pretrained`` when ``reference`` is a name or path.
            ld_alpha: DPO's LD-DPO weight (part of the precompute cache key).
        """
        (sync_on, alpha, steps), (precompute_on, batch_size, cache_dir) = sync, precompute
        self.reference = ReferenceModel(
            self,
            sync=sync_on,
            mixup_alpha=alpha,
            sync_steps=steps,
            precompute=precompute_on,
            precompute_batch_size=batch_size,
            cache_dir=cache_dir,
            ld_alpha=ld_alpha,
            data_module=self.data_module,
        )
        self.reference.build(reference, disable_dropout=disable_dropout, trust_remote_code=trust_remote_code)

    @property
    def _precomputed(self) -> _ref_logps.PrecomputedReference:
        """The precomputed reference log-probs (``self.reference.precomputed``)."""
        return self.reference.precomputed

    def precompute_reference_logps(self, splits: tuple[str, ...], release: bool = True) -> None:
        """Score ``splits`` of the trainer's data module with the reference once, store them, free the reference
        (:meth:`~lit_trainer.modules.reference.ReferenceModel.precompute_logps`).

        Args:
            splits: ``"train"`` and/or ``"validation"`` (a split without data is skipped).
            release: free the reference model afterwards (``fit`` does; a ``validate`` before fitting does not).

        Raises:
            ValueError: without a data module that can store them, or when the reference is gone (released, or the
                policy has been trained) and the data has none yet.
        """
        self.reference.precompute_logps(splits, release=release)

    # ------------------------------------------------------------------------------------------ Lightning hooks
    @override
    def train(self, mode: bool = True) -> Self:
        """Set the policy's mode; the reference model always stays in eval mode."""
        super().train(mode)
        if getattr(self, "reference", None) is not None:
            self.reference.keep_eval()
        return self

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.reference.check_strategy(self.trainer.strategy)

    @override
    def on_fit_start(self) -> None:
        self.reset_reference_sync()
        if self.reference.precompute:
            self.precompute_reference_logps(("train", "validation"))

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.reference.precompute and self.trainer.state.fn == TrainerFn.VALIDATING:
            self.precompute_reference_logps(("validation",), release=False)  # a later fit still needs the reference

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        self.reference.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the precomputed log-probs; reconcile ``ref_model.*`` weights saved before/after the release."""
        super().on_load_checkpoint(checkpoint)
        self.reference.on_load_checkpoint(checkpoint)
