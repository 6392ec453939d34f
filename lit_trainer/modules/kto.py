"""KTOModule: Kahneman-Tversky optimisation on unpaired thumbs-up/down data (TRL 1.16 ``KTOTrainer`` semantics).

A sibling of :class:`~lit_trainer.modules.dpo.DPOModule`: both are
:class:`~lit_trainer.modules.preference.ReferencePreferenceModule` s, which hold the reference model
(:class:`~lit_trainer.modules.reference.ReferenceModel`: ``ref_model=None`` = a frozen in-memory copy; under peft the
adapter-disabled policy; eval mode, no gradients, in checkpoints; TR-DPO synchronisation; the precompute pass) and
share dropout disabling, the strategy checks and the chunked per-token log-probs. What is KTO's own is here: scoring
the B rows of an unpaired batch and their mismatched ``KL_*`` rows, the KL estimate (all-reduced over ranks) and the
loss terms of :func:`~lit_trainer.losses.kto.kto_loss`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from transformers import PreTrainedModel
from typing_extensions import override

from lit_trainer.data.unpaired import KL_PREFIX, REF_KEY, REF_KL_KEY
from lit_trainer.losses.kto import (
    KL_LOSS_TYPES,
    KTOLossType,
    check_kto_options,
    kto_kl,
    kto_kl_terms,
    kto_loss,
    kto_rewards_metrics,
    label_balance_problem,
)  # fmt: skip
from lit_trainer.modules.preference import ReferencePreferenceModule
from lit_trainer.modules.scoring import RowScores

__all__ = ["KTO_METRIC_NAMES", "KTOModule"]

#: what is logged (training; validation adds the ``val_`` prefix and ``val_loss``), TRL 1.16's names
KTO_METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "kl",
)


class KTOModule(ReferencePreferenceModule):
    """Align a causal LM on unpaired desirable/undesirable examples with KTO (TRL 1.16 ``KTOTrainer`` semantics).

    A batch (from :class:`~lit_trainer.data.unpaired.UnpairedPreferenceDataModule`) holds B rows ``(x_i, y_i)`` with
    labels, and B mismatched rows ``(x_i, y'_i)``: each row's KL partner, fixed at preprocessing as TRL (completions
    rotated by one inside consecutive chunks of ``batch_size`` rows; with sequential sampling a micro-batch is a
    chunk). Each step runs the policy on the B rows (with gradients), the reference on the same rows, and, for
    ``loss_type="kto"``, the policy and the reference on the mismatched rows without gradients: their mean log-ratio,
    averaged over every rank's rows (one all-reduce per micro-batch) and clamped at 0, is the KL estimate ``z₀``
    (detached, as TRL). The per-example losses of :func:`~lit_trainer.losses.kto.kto_loss` are summed over the
    micro-batch and divided by the optimizer step's global EXAMPLE count (KTO's loss is a mean over examples): with
    one micro-batch on one device this is TRL's loss, and under accumulation and DDP the step's gradient is the
    full-batch one for the KL estimates the micro-batches saw. The estimate itself is per micro-batch (global over
    ranks), as in TRL, over the micro-batch's rows' partners. Because a row's partner is fixed,
    ``precompute_ref_log_probs`` can score both once and free the reference.

    Logged (window means over micro-batches): ``rewards/{chosen,rejected,margins}``, ``logps/{chosen,rejected}``,
    ``logits/{chosen,rejected}`` and ``kl``; validation logs them with a ``val_`` prefix plus ``val_loss`` (the mean
    over the set's examples; the KL estimate there is each validation batch's own, no collective).

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel`` (the policy).
        ref_model: None (a frozen copy of the policy; with ``peft_config`` the policy with its adapters disabled), a
            path/hub id/preset to load, or a ``PreTrainedModel``.
        loss_type: ``"kto"`` (default) or ``"apo_zero_unpaired"`` (no KL estimate, no mismatched rows needed).
        beta: ``β`` of the loss and the rewards.
        desirable_weight: ``λ_D``, the weight of desirable examples' losses (balance unequal label counts).
        undesirable_weight: ``λ_U``, the weight of undesirable examples' losses.
        precompute_ref_log_probs: score every training and validation row AND its KL partner (fixed per row by the
            data module) with the reference once at fit start, store them with the dataset (``ref_logps`` /
            ``ref_KL_logps``), then free the reference model (DPO's pass: cached by data and reference fingerprint,
            gathered over DDP ranks, kept in checkpoints; see :mod:`lit_trainer.modules.reference._ref_logps`). With
            ``ref_model=None`` and no LoRA no copy is made: the policy scores the data before its first update.
        precompute_ref_batch_size: rows per batch of that pass (default: the data module's eval batch size).
        ref_logps_cache_dir: directory for the precomputed log-probs (default: next to the dataset's cache files
            when it has some; otherwise in memory and in checkpoints only).
        sync_ref_model: TR-DPO reference synchronisation (see :class:`~lit_trainer.modules.dpo.DPOModule`).
        ref_model_mixup_alpha: ``α`` of TR-DPO, in [0, 1].
        ref_model_sync_steps: TR-DPO period in optimizer steps.
        disable_dropout: zero every dropout of the policy and the reference (TRL's default).
        learning_rate: peak learning rate (TRL's KTO default 1e-6).
        trust_remote_code: passed to ``from_pretrained`` for both models.
        **kwargs: optimizer, scheduler, LoRA and clipping options of :class:`~lit_trainer.modules.base.BaseModule`.

    Raises:
        ValueError: an unknown loss type, ``beta <= 0``, a negative weight, ``precompute_ref_log_probs`` with
            ``sync_ref_model``, ``precompute_ref_batch_size < 1``, invalid TR-DPO options, ``ref_model`` being the
            policy object itself; at setup, ``loss_type="kto"`` with a batch size below 2 (a chunk of one row has no
            mismatched partner).

    Warns:
        UserWarning: at setup, once, when the training labels are one kind only, or unequal with weights that do not
            balance them (:func:`~lit_trainer.losses.kto.label_balance_problem`).

    Example::

        module = KTOModule("runs/sft/version_0/hf_model", learning_rate=3e-4)
        data = UnpairedPreferenceDataModule("runs/sft/version_0/hf_model", batch_size=64, max_length=32)
        lightning.Trainer(max_steps=300).fit(module, datamodule=data)
    """

    RUN_NAME: ClassVar[str] = "kto"  # the run folder `lit-trainer fit` uses without --run_name

    metric_names = KTO_METRIC_NAMES
    data_module = "UnpairedPreferenceDataModule"

    def __init__(
        self,
        model: str | PreTrainedModel = "tiny",
        *,
        ref_model: str | PreTrainedModel | None = None,
        loss_type: KTOLossType = "kto",
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        precompute_ref_log_probs: bool = False,
        precompute_ref_batch_size: int | None = None,
        ref_logps_cache_dir: str | None = None,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
        disable_dropout: bool = True,
        learning_rate: float = 1e-6,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        check_kto_options(loss_type, beta, desirable_weight, undesirable_weight)
        # keep a model object out of the hyperparameters (Lightning would deep-copy it), as DPOModule does
        reference, ref_model = ref_model, ref_model if ref_model is None or isinstance(ref_model, str) else None
        super().__init__(
            model,
            disable_dropout=disable_dropout,
            learning_rate=learning_rate,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        self._loss_options = {
            "loss_type": loss_type,
            "beta": beta,
            "desirable_weight": desirable_weight,
            "undesirable_weight": undesirable_weight,
        }
        self.hold_reference(
            reference,
            sync=(sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps),
            precompute=(precompute_ref_log_probs, precompute_ref_batch_size, ref_logps_cache_dir),
            disable_dropout=disable_dropout,
            trust_remote_code=trust_remote_code,
        )

    @property
    def uses_kl(self) -> bool:
        """Whether the loss type reads the KL estimate (and so the batch's mismatched ``KL_*`` rows)."""
        return self._loss_options["loss_type"] in KL_LOSS_TYPES

    # ------------------------------------------------------------------------------------------------- scoring
    def reference_logps(self, batch: dict[str, Tensor], prefix: str = "") -> Tensor:
        """The reference's per-sequence log-probs of the rows (``prefix=""``) or of their KL partners (``"KL_"``):
        the batch's precomputed ``ref_logps`` / ``ref_KL_logps`` when it has them, else the live reference (no grad).

        Raises:
            ValueError: when the batch has no precomputed values and the reference model has been released.
        """
        key = REF_KL_KEY if prefix else REF_KEY
        return self.reference.logps(batch, (key,), lambda network: self.score_rows(network, batch, prefix).seq)

    def kl_terms(self, batch: dict[str, Tensor]) -> Tensor | None:
        """``[Σ log-ratio, count]`` of the batch's mismatched rows (no gradient), or None when the loss needs none.

        Raises:
            ValueError: when the loss needs them and the batch has no ``KL_*`` rows.
        """
        if not self.uses_kl:
            return None
        if KL_PREFIX + "input_ids" not in batch:
            raise ValueError(
                f"KTOModule(loss_type={self._loss_options['loss_type']!r}) needs the mismatched rows "
                f"`{KL_PREFIX}input_ids`/`{KL_PREFIX}attention_mask`/`{KL_PREFIX}completion_mask` in every batch: "
                "train with `UnpairedPreferenceDataModule(mismatched_pairs=True)` (the default)."
            )
        with torch.no_grad():
            policy = self.score_rows(self.model, batch, KL_PREFIX).seq
        reference = self.reference_logps(batch, KL_PREFIX)
        return kto_kl_terms(policy, reference)

    def _losses(self, batch: dict[str, Tensor], global_kl: bool) -> tuple[Tensor, RowScores, Tensor, Tensor | None]:
        """``(per-example losses, policy scores, reference log-probs, KL estimate or None)`` of one batch."""
        terms = self.kl_terms(batch)
        if terms is not None and global_kl and self._trainer is not None and self.trainer.world_size > 1:
            terms = self.trainer.strategy.reduce(terms, reduce_op="sum")  # every rank's mismatched rows (TRL: gather)
        kl = kto_kl(terms) if terms is not None else None
        scores = self.score_rows(self.model, batch, stats=True)
        ref = self.reference_logps(batch)
        losses = kto_loss(scores.seq, ref, batch["label"], kl, **self._loss_options)
        return losses, scores, ref, kl

    # --------------------------------------------------------------------------------------------- loss and metrics
    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        losses, scores, ref, kl = self._losses(batch, global_kl=True)
        count = losses.numel() if num_items_in_batch is None else num_items_in_batch.reshape(-1)[0]
        return losses.sum() / count, self._metrics(scores, ref, batch["label"], kl)

    def _metrics(self, scores: RowScores, ref: Tensor, labels: Tensor, kl: Tensor | None) -> dict[str, Tensor]:
        labels = labels.to(torch.bool)
        metrics = kto_rewards_metrics(scores.seq, ref, labels, self._loss_options["beta"])
        metrics.update(self.logits_metrics(scores, labels, ~labels))
        metrics["kl"] = kl.clamp(min=0) if kl is not None else scores.seq.new_zeros(()).detach()
        return metrics

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        losses, scores, ref, kl = self._losses(batch, global_kl=False)  # uneven eval batches: no collective
        labels = batch["label"].to(torch.bool)
        rows, chosen = losses.numel(), int(labels.sum())
        self.val_metrics["loss"].update(losses.mean(), weight=rows)
        weights = {"chosen": chosen, "rejected": rows - chosen}
        tokens = {side: scores.mask[m].sum() for side, m in (("chosen", labels), ("rejected", ~labels))}
        for name, value in self._metrics(scores, ref, labels, kl).items():
            if name == "rewards/margins":
                continue  # derived from the set's means in finalize_val_metrics
            kind, _, side = name.partition("/")
            weight = rows if not side else tokens[side] if kind == "logits" else weights[side]
            if float(weight) > 0:
                self.val_metrics[name].update(value, weight=weight)

    @override
    def finalize_val_metrics(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """``val_rewards/margins`` from the set's mean chosen and rejected rewards."""
        if "val_rewards/chosen" in values and "val_rewards/rejected" in values:
            values["val_rewards/margins"] = values["val_rewards/chosen"] - values["val_rewards/rejected"]
        return values

    # -------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        size = getattr(datamodule, "hparams", {}).get("batch_size")
        if stage == "fit" and self.uses_kl and isinstance(size, int) and size < 2:
            raise ValueError(
                f"`KTOModule(loss_type='kto')` with batch_size={size}: the KL partners are the completions rotated "
                "inside chunks of batch_size rows, so a chunk needs >= 2 rows. Raise batch_size "
                "(e.g. 8 or more), or use loss_type='apo_zero_unpaired'."
            )
        counts = datamodule.label_counts() if callable(getattr(datamodule, "label_counts", None)) else None
        if stage == "fit" and counts is not None:
            weights = (self._loss_options["desirable_weight"], self._loss_options["undesirable_weight"])
            problem = label_balance_problem(*counts, *weights)
            if problem is not None:
                rank_zero_warn(f"[lit_trainer] KTOModule: {problem}")
