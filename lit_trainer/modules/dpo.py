"""DPOModule: direct preference optimisation against a frozen reference model, with every TRL 1.16 pair loss.

The module's options and their validation, and its loss: the pair terms and the ``sft`` term of a batch, and the
logged reward/log-prob/logit metrics. The reference model (its modes, TR-DPO sync, the precompute pass, its release,
its checkpoint entries) is a :class:`~lit_trainer.modules.reference.ReferenceModel` held by the base
:class:`~lit_trainer.modules.preference.ReferencePreferenceModule`, which KTO shares.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor
from transformers import PreTrainedModel
from typing_extensions import override

from lit_trainer.data.packing import row_completion_mask
from lit_trainer.data.preference.collate import REF_CHOSEN_KEY, REF_REJECTED_KEY
from lit_trainer.losses.dpo import (
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCE_TYPES,
    DPOLossType,
    FDivergenceType,
    dpo_loss,
    dpo_rewards_metrics,
)  # fmt: skip
from lit_trainer.modules.preference import ReferencePreferenceModule
from lit_trainer.modules.scoring import RowScores

LossName = Literal[DPOLossType, "sft"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)  # nested Literals flatten: the DPO loss types, then "sft"
# `Scores` is public here: it is the type of `pair_losses(scores, ...)`, which a subclass overrides
__all__ = ["METRIC_NAMES", "DPOModule", "Scores"]

Scores = RowScores
"""One forward of 2B rows (:class:`~lit_trainer.modules.scoring.RowScores`): per-sequence sums, shifted per-token
log-probs and mask, vocabulary-mean logits."""

_SFT_NLL = "sft_nll"
METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)


def _validate_losses(loss_type: Any, loss_weights: list[float] | None, options: dict[str, Any]) -> tuple[list, list]:
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    unknown = [t for t in types if t not in LOSS_NAMES]
    if not types or unknown:
        raise ValueError(f"`DPOModule(loss_type={loss_type!r})` is invalid: give one or more of {LOSS_NAMES}.")
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(
            f"`DPOModule(loss_weights={loss_weights!r})` has {len(weights)} entries for {len(types)} "
            f"loss types {types}: give one weight per type, or none (all 1.0)."
        )
    divergence = options["f_divergence_type"]
    if divergence not in F_DIVERGENCE_TYPES:
        raise ValueError(f"`DPOModule(f_divergence_type={divergence!r})` is invalid: use one of {F_DIVERGENCE_TYPES}.")
    unsupported = [t for t in types if t not in F_DIVERGENCE_LOSS_TYPES]
    if divergence != "reverse_kl" and unsupported:
        raise ValueError(
            f"`DPOModule(f_divergence_type={divergence!r})` is not supported by the loss types "
            f"{unsupported}: use 'reverse_kl' or only types from {F_DIVERGENCE_LOSS_TYPES}."
        )
    one = torch.zeros(1)
    for name in set(types) - {"sft"}:  # the loss function's own checks, at construction instead of at step 1
        try:
            dpo_loss(one, one, one, one, loss_type=name, chosen_lengths=one, rejected_lengths=one, **options)
        except ValueError as err:
            raise ValueError(f"DPOModule: {err}") from None
    return types, weights


class DPOModule(ReferencePreferenceModule):
    """Align a causal LM on preference pairs with DPO and its variants (TRL 1.16 ``DPOTrainer`` semantics).

    Each step runs chosen and rejected rows in ONE forward of 2B rows; per-sequence log-probs are sums of
    ``per_token_logps`` over completion tokens. The pair terms ``Σ_k w_k ℓ^{(k)}``
    (:func:`~lit_trainer.losses.dpo_loss`) are summed over the micro-batch and divided by the global PAIR count of
    the optimizer step; the ``"sft"`` term (RPO's NLL) is, as in TRL, a token mean over the chosen completion tokens:
    the summed NLL is divided by the global count of chosen tokens of the optimizer step (the second count the
    :class:`~lit_trainer.data.preference.PreferenceDataModule` attaches). With one micro-batch on one device this is
    TRL's loss; under accumulation and DDP it is the full-batch loss of the step, for every term. Logged (window
    means): ``rewards/{chosen,rejected,accuracies,margins}``, ``logps/{chosen,rejected}``, ``logits/{chosen,
    rejected}``; validation logs the same with a ``val_`` prefix plus ``val_loss`` (pair terms averaged over the
    set's pairs, ``sft`` over its chosen tokens). ``aot``/``aot_unpaired`` sort within a micro-batch (as TRL), so
    they are the only types whose accumulated gradient differs from a full batch.

    The reference model is ``self.ref_model`` (parameter names mirror ``self.model``): eval mode, no gradients, not in
    the optimizer nor in clipping, saved in checkpoints, never trained. Unlike TRL (which reloads it from disk and
    fails for an in-memory model), ``ref_model=None`` makes a frozen in-memory copy of the policy. Runs on one device
    or under DDP, or sharded under ``ModelParallelStrategy`` (FSDP2: the reference is sharded like the policy;
    ``precompute_ref_log_probs`` is refused there); FSDP1 and DeepSpeed are refused at setup.

    With ``peft_config`` (LoRA) and ``ref_model=None`` there is no copy: the reference is the policy network with its
    adapters disabled (the base model), or, with ``adapter_path``, with a frozen second load of that adapter active
    (the adapter's starting point); see :class:`~lit_trainer.modules.base._peft.AdapterReference`. ``sync_ref_model`` is
    refused then; ``precompute_ref_log_probs`` works and keeps that reference for new data. Under
    ``ModelParallelStrategy`` the base and the adapters are sharded, and every rank runs the adapter-disabled reference
    forward at the same point of the step (a collective).

    A vision-language model (``"tiny-vl"``, a saved one) trains on preference pairs with images (see
    :class:`~lit_trainer.data.preference.PreferenceDataModule`): the batch's image inputs go to the policy AND the
    reference, so both score the pair with its pictures; ``precompute_ref_log_probs`` is refused for such data.

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel`` (the policy).
        ref_model: None (a frozen copy of the policy; with ``precompute_ref_log_probs`` no copy at all: the policy
            scores the data before its first update; with ``peft_config`` the policy with its adapters disabled),
            a path/hub id/preset to load, or a ``PreTrainedModel``.
        loss_type: one loss name or a list, from the pair types of ``dpo_loss`` plus ``"sft"``.
        loss_weights: one weight per loss type (default all 1.0). RPO is ``["sigmoid", "sft"]`` with ``[1.0, 1.0]``.
        beta: ``β`` of the pair losses and the rewards.
        label_smoothing: ``ε`` of robust, exo_pair, aot and aot_unpaired.
        f_divergence_type: ``reverse_kl`` (default), ``forward_kl``, ``js_divergence`` or ``alpha_divergence``.
        f_alpha_divergence_coef: ``a`` of ``alpha_divergence``.
        discopop_tau: ``τ`` of discopop.
        ld_alpha: LD-DPO weight of the tokens beyond the shorter completion of a pair (None = off), in [0, 1].
        precompute_ref_log_probs: score the training and validation pairs with the reference once at fit start,
            store them with the dataset (see :mod:`lit_trainer.modules.reference._ref_logps`), then free the reference
            model.
        precompute_ref_batch_size: pairs per batch of that pass (default: the data module's eval batch size).
        ref_logps_cache_dir: directory for the precomputed log-probs (default: next to the dataset's cache files
            when it has some; otherwise kept in memory and in checkpoints only).
        sync_ref_model: TR-DPO: after every ``ref_model_sync_steps``-th optimizer step,
            ``θ_ref ← (1−α)θ_ref + αθ_policy`` with ``α = ref_model_mixup_alpha`` (parameters only).
        ref_model_mixup_alpha: ``α`` of TR-DPO, in [0, 1].
        ref_model_sync_steps: TR-DPO period in optimizer steps.
        disable_dropout: zero every dropout of the policy and the reference (TRL's default).
        learning_rate: peak learning rate (TRL's DPO default 1e-6).
        trust_remote_code: passed to ``from_pretrained`` for both models.
        **kwargs: optimizer, scheduler and clipping options of :class:`~lit_trainer.modules.base.BaseModule`.

    Raises:
        ValueError: unknown loss types, mismatched weights, an f-divergence a selected type does not support, invalid
            ``beta``/``label_smoothing``/``discopop_tau``/``ld_alpha``/TR-DPO options, ``sync_ref_model`` with
            ``precompute_ref_log_probs`` or with ``peft_config``/``adapter_path``, or ``ref_model`` being the policy
            object itself.

    Example::

        module = DPOModule("runs/sft/hf_model", loss_type=["sigmoid", "sft"], learning_rate=3e-4)
        trainer = lightning.Trainer(max_steps=300, accumulate_grad_batches=2)
        trainer.fit(module, datamodule=PreferenceDataModule("runs/sft/hf_model", batch_size=32, max_length=32))
    """

    RUN_NAME: ClassVar[str] = "dpo"  # the run folder `lit-trainer fit` uses without --run_name

    metric_names = (*METRIC_NAMES, _SFT_NLL)

    def __init__(
        self,
        model: str | PreTrainedModel = "tiny",
        *,
        ref_model: str | PreTrainedModel | None = None,
        loss_type: LossName | list[LossName] = "sigmoid",
        loss_weights: list[float] | None = None,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        f_divergence_type: FDivergenceType = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        discopop_tau: float = 0.05,
        ld_alpha: float | None = None,
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
        # the base records this frame's arguments as hparams: keep a model object out (Lightning would deep-copy it)
        reference, ref_model = ref_model, ref_model if ref_model is None or isinstance(ref_model, str) else None
        super().__init__(
            model,
            disable_dropout=disable_dropout,
            learning_rate=learning_rate,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        self._loss_options = {
            "beta": beta,
            "label_smoothing": label_smoothing,
            "discopop_tau": discopop_tau,
            "f_divergence_type": f_divergence_type,
            "f_alpha_divergence_coef": f_alpha_divergence_coef,
        }
        self.loss_types, self.loss_weights = _validate_losses(loss_type, loss_weights, self._loss_options)
        self.sft_weight = sum(w for name, w in zip(self.loss_types, self.loss_weights) if name == "sft")
        if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
            raise ValueError(f"`DPOModule(ld_alpha={ld_alpha})` is invalid: use a weight in [0, 1] or None.")
        self.hold_reference(
            reference,
            sync=(sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps),
            precompute=(precompute_ref_log_probs, precompute_ref_batch_size, ref_logps_cache_dir),
            disable_dropout=disable_dropout,
            trust_remote_code=trust_remote_code,
            ld_alpha=ld_alpha,
        )

    # ------------------------------------------------------------------------------------------------- scoring
    @override
    def scoring_options(self) -> dict[str, Any]:
        """LD-DPO's ``ld_alpha`` (rows ``0..B-1`` chosen, ``B..2B-1`` rejected)."""
        return {"ld_alpha": self.hparams.ld_alpha}

    def _reference_logps(self, batch: dict[str, Tensor]) -> Tensor:
        """``(2B,)`` reference log-probs: the batch's precomputed ``ref_chosen_logps``/``ref_rejected_logps``, else the
        live reference (no grad)."""
        columns = (REF_CHOSEN_KEY, REF_REJECTED_KEY)
        return self.reference.logps(batch, columns, lambda network: self.score(network, batch).seq)

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
        return {**metrics, **self.logits_metrics(scores, slice(None, pairs), slice(pairs, None))}

    # --------------------------------------------------------------------------------------------- loss and metrics
    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        scores = self.score(self.model, batch, stats=True)
        ref = self._reference_logps(batch)
        return self._total_loss(scores, ref, batch, num_items_in_batch), self._metrics(scores, ref)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        scores = self.score(self.model, batch, stats=True)
        ref = self._reference_logps(batch)
        losses = self.pair_losses(scores, ref, row_completion_mask(batch))
        pairs = losses.numel()
        self.val_metrics["loss"].update(losses.mean(), weight=pairs)
        nll, tokens = self.chosen_nll(scores)
        self.val_metrics[_SFT_NLL].update(nll / tokens.clamp(min=1), weight=tokens)
        for name, value in self._metrics(scores, ref).items():
            self.val_metrics[name].update(value, weight=pairs)

    @override
    def finalize_val_metrics(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """Add the sft term to ``val_loss`` (its mean NLL over the set's chosen tokens, weighted); not logged alone."""
        nll = values.pop(f"val_{_SFT_NLL}", None)
        if "val_loss" in values and nll is not None and self.sft_weight:
            values["val_loss"] = values["val_loss"] + self.sft_weight * nll
        return values
