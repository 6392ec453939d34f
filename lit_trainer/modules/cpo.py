"""CPO, SimPO and AlphaPO (:class:`CPOModule`): preference optimisation without a reference model, TRL 1.16's
experimental ``CPOTrainer`` numerics. Its scoring, two-term loss and validation are the reference-free base's
(:mod:`lit_trainer.modules._reference_free`); the pure losses are in :mod:`lit_trainer.losses.reference_free`."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor
from transformers import PreTrainedModel
from typing_extensions import override

from lit_trainer.losses.dpo import pair_reward_metrics
from lit_trainer.losses.reference_free import (
    AVERAGED_LOSS_TYPES,
    CPOLossType,
    check_cpo_options,
    cpo_loss,
    cpo_rewards,
)
from lit_trainer.modules._reference_free import _ReferenceFreeModule

__all__ = ["CPOModule"]


class CPOModule(_ReferenceFreeModule):
    """CPO and its reference-free relatives: SimPO and AlphaPO (TRL 1.16 ``experimental.cpo.CPOTrainer``).

    Per optimizer step: ``mean_pairs ℓ + cpo_alpha · NLL``, with ``ℓ`` from
    :func:`~lit_trainer.losses.reference_free.cpo_loss` (``sigmoid``/``hinge`` on SUMMED completion log-probs,
    ``ipo``/``simpo``/``alphapo`` on per-token AVERAGED ones) and ``NLL`` the token-mean negative log-likelihood of the
    chosen completion tokens (the behaviour-cloning term). The pair term is divided by the step's pair count and the
    NLL by the step's chosen completion tokens (the data module's two counts), so ``accumulate_grad_batches=N`` gives
    the full-batch gradient; with one micro-batch on one device it is TRL's loss.

    **SimPO** is ``CPOModule(loss_type="simpo", simpo_gamma=..., cpo_alpha=0.0)``, as in TRL (SimPO's paper uses
    ``β`` of 2 to 10); ``cpo_alpha > 0`` gives CPO-SimPO. **AlphaPO** is ``loss_type="alphapo"``
    with ``alpha != 0``: SimPO with the reward ``(1 − p^{−α})/α``; like TRL it sets ``cpo_alpha = 0``. ``alpha`` also
    reshapes the reward of the other loss types.

    Logged (TRL's names): ``rewards/chosen``/``rewards/rejected`` (``β`` × the reward: log-probs, or AlphaPO's),
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``/``logps/rejected`` (summed or averaged as the loss
    takes them), ``logits/chosen``/``logits/rejected``, ``nll_loss``; validation the same with ``val_`` plus
    ``val_loss``.

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel`` (the policy).
        loss_type: ``sigmoid`` (CPO), ``hinge``, ``ipo``, ``simpo`` or ``alphapo``.
        beta: ``β`` > 0 (TRL's default 0.1).
        label_smoothing: ``ε`` in [0, 1) for sigmoid, simpo and alphapo (refused for hinge/ipo, which TRL ignores).
        cpo_alpha: weight of the NLL term (TRL's default 1.0; SimPO: 0; forced to 0 by ``alphapo``).
        simpo_gamma: ``γ``, SimPO's target reward margin (simpo and alphapo; TRL's default 0.5).
        alpha: AlphaPO's reward shape (0: the log-probs; needed non-zero by ``alphapo``).
        disable_dropout: zero every dropout (TRL's default).
        learning_rate: peak learning rate (TRL's default 1e-6; the addition recipe uses 3e-4).
        trust_remote_code: passed to ``from_pretrained``.
        **kwargs: optimizer, scheduler, LoRA, sharding and chunking options of
            :class:`~lit_trainer.modules.base.BaseModule`.

    Raises:
        ValueError: an unknown ``loss_type``, ``beta <= 0``, ``label_smoothing`` outside [0, 1) or with hinge/ipo,
            a negative ``cpo_alpha``, ``alphapo`` with ``alpha == 0``.

    Example::

        simpo = CPOModule("runs/sft/version_0/hf_model", loss_type="simpo", beta=2.0, simpo_gamma=1.0, cpo_alpha=0.0)
        trainer = lightning.Trainer(max_steps=300)
        trainer.fit(simpo, datamodule=PreferenceDataModule("runs/sft/version_0/hf_model", batch_size=64))
    """

    RUN_NAME: ClassVar[str] = "cpo"  # the run folder `lit-trainer fit` uses without --run_name

    def __init__(
        self,
        model: str | PreTrainedModel = "tiny",
        *,
        loss_type: CPOLossType = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        cpo_alpha: float = 1.0,
        simpo_gamma: float = 0.5,
        alpha: float = 0.0,
        disable_dropout: bool = True,
        learning_rate: float = 1e-6,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        try:
            check_cpo_options(loss_type, beta, label_smoothing, alpha)
        except ValueError as err:
            raise ValueError(f"CPOModule: {err}") from None
        if cpo_alpha < 0:
            raise ValueError(f"`CPOModule(cpo_alpha={cpo_alpha})` is invalid: the NLL weight must be >= 0.")
        self.loss_type, self.averaged = loss_type, loss_type in AVERAGED_LOSS_TYPES
        self.nll_weight = 0.0 if loss_type == "alphapo" else float(cpo_alpha)  # TRL: alphapo = simpo, cpo_alpha 0
        self._options = {"beta": beta, "label_smoothing": label_smoothing, "simpo_gamma": simpo_gamma, "alpha": alpha}
        super().__init__(
            model,
            disable_dropout=disable_dropout,
            learning_rate=learning_rate,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )

    @override
    def pair_terms(self, chosen: Tensor, rejected: Tensor) -> Tensor:
        return cpo_loss(chosen, rejected, loss_type=self.loss_type, **self._options)

    @override
    def pair_metrics(self, chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
        beta, alpha = self._options["beta"], self._options["alpha"]
        return pair_reward_metrics(beta * cpo_rewards(chosen, alpha), beta * cpo_rewards(rejected, alpha))
