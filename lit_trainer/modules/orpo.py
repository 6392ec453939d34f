"""ORPO (:class:`ORPOModule`): odds-ratio preference optimisation without a reference model, TRL 1.16's experimental
``ORPOTrainer`` numerics. Its scoring, two-term loss and validation are the reference-free base's
(:mod:`lit_trainer.modules._reference_free`); the pure losses are in :mod:`lit_trainer.losses.reference_free`."""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel
from typing_extensions import override

from lit_trainer.losses.dpo import pair_reward_metrics
from lit_trainer.losses.reference_free import (
    orpo_log_odds,
    orpo_loss,
)
from lit_trainer.modules._reference_free import ORPO_METRIC_NAMES, _ReferenceFreeModule

__all__ = ["ORPOModule"]


class ORPOModule(_ReferenceFreeModule):
    """ORPO: odds-ratio preference optimisation, SFT and preference in one loss, no reference model (TRL 1.16
    ``experimental.orpo.ORPOTrainer``).

    Per optimizer step: ``NLL + mean_pairs(−β · log σ(L))``, where ``L`` is the log odds ratio of the chosen over the
    rejected completion (:func:`~lit_trainer.losses.reference_free.orpo_log_odds`) computed from per-token AVERAGED
    completion log-probs, and ``NLL`` the token-mean negative log-likelihood of the chosen rows. As in TRL the NLL
    covers the chosen rows' prompt tokens too (``nll_on_prompt=True``; False: completion tokens only). The pair term
    is divided by the step's pair count, the NLL by the step's count of its tokens (over micro-batches and ranks), so
    ``accumulate_grad_batches=N`` gives the full-batch gradient; with one micro-batch on one device it is TRL's loss.

    Logged (TRL's names): ``rewards/chosen``/``rewards/rejected`` (``β`` × averaged log-probs), ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``/``logps/rejected`` (averaged), ``logits/chosen``/``logits/rejected``,
    ``nll_loss``, ``log_odds_ratio`` (``mean log σ(L)``) and ``log_odds_chosen`` (``mean L``); validation the same with
    ``val_`` plus ``val_loss``.

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel`` (the policy).
        beta: ``β``, the paper's ``λ``: the weight of the odds-ratio term (TRL's default 0.1).
        nll_on_prompt: the NLL term also covers the prompt tokens of the chosen rows (TRL 1.16); its token count is
            the third count of ``PreferenceDataModule.count_items``.
        disable_dropout: zero every dropout (TRL's default).
        learning_rate: peak learning rate (TRL's default 1e-6; the addition recipe uses 3e-4).
        trust_remote_code: passed to ``from_pretrained``.
        **kwargs: optimizer, scheduler, LoRA, sharding and chunking options of
            :class:`~lit_trainer.modules.base.BaseModule`.

    Raises:
        ValueError: ``beta <= 0``; in training, a loader whose ``num_items_in_batch`` lacks the NLL count.

    Example::

        module = ORPOModule("runs/sft/version_0/hf_model", beta=0.1, learning_rate=3e-4)
        trainer = lightning.Trainer(max_steps=300)
        trainer.fit(module, datamodule=PreferenceDataModule("runs/sft/version_0/hf_model", batch_size=64))
    """

    RUN_NAME: ClassVar[str] = "orpo"  # the run folder `lit-trainer fit` uses without --run_name

    averaged = True
    metric_names = ORPO_METRIC_NAMES

    def __init__(
        self,
        model: str | PreTrainedModel = "tiny",
        *,
        beta: float = 0.1,
        nll_on_prompt: bool = True,
        disable_dropout: bool = True,
        learning_rate: float = 1e-6,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> None:
        if not beta > 0:
            raise ValueError(f"`ORPOModule(beta={beta})` is invalid: beta (ORPO's lambda) must be > 0, e.g. 0.1.")
        self.beta, self.nll_on_prompt = float(beta), bool(nll_on_prompt)
        super().__init__(
            model,
            disable_dropout=disable_dropout,
            learning_rate=learning_rate,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )

    @override
    def pair_terms(self, chosen: Tensor, rejected: Tensor) -> Tensor:
        return orpo_loss(chosen, rejected, beta=self.beta)

    @override
    def pair_metrics(self, chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
        log_odds = orpo_log_odds(chosen, rejected)
        return {
            **pair_reward_metrics(self.beta * chosen, self.beta * rejected),
            "log_odds_ratio": F.logsigmoid(log_odds).mean(),
            "log_odds_chosen": log_odds.mean(),
        }
