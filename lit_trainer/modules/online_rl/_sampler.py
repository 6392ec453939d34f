"""Rounds sampled by another computation than the trainer's forward: the importance-sampling correction of their loss
and the sampler check of their log-probs.

Two cases share this: asynchronous GRPO, whose rollout worker samples with weights up to ``max_staleness`` rounds old
(:mod:`lit_trainer.modules.grpo._async`), and an engine whose numerics are not the trainer's (vLLM), whether it runs
behind that worker or in the training process (RLOO). Either way the round keeps the sampler's own log-probs of its
tokens (the behaviour log-probs, key ``sampling_logps`` of the round's rows) and:

* the loss of each micro-batch is multiplied by the truncated or masked ratio ``exp(old - behaviour)`` of the
  trainer's log-probs at the start of the round to the sampler's (:class:`SamplerCorrection`; TRL 1.16's
  ``vllm_importance_sampling_*`` numerics, :func:`~lit_trainer.losses.grpo_masks.sampling_importance_ratio`);
* every round, the trainer's log-probs of some of the round's tokens under the weights that sampled them are compared
  with the sampler's (:class:`SamplerCheck`): on the same weights the gap is float32 rounding, so a weight sync that
  never reached the sampler shows at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_trainer.losses.grpo_masks import SamplingISMode, sampling_importance_ratio, sampling_metrics
from lit_trainer.modules.online_rl._rollout_buffer import SAMPLING_LOGPS


@dataclass(frozen=True)
class SamplerCorrection:
    """The importance-sampling correction of a round that carries the sampler's log-probs (``sampling_logps``): the
    module options ``rollout_importance_sampling_*`` (:meth:`from_hparams`)."""

    enabled: bool
    mode: SamplingISMode
    clip_min: float | None
    clip_max: float | None

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> SamplerCorrection:
        return cls(
            hparams["rollout_importance_sampling_correction"],
            hparams["rollout_importance_sampling_mode"],
            hparams["rollout_importance_sampling_clip_min"],
            hparams["rollout_importance_sampling_clip_max"],
        )

    def ratio(self, batch: Mapping[str, Any], logps: Tensor, old: Tensor | None) -> tuple[Tensor | None, dict]:
        """The correction of one buffered micro-batch (None when its round carries no sampler log-probs) and TRL's
        ``sampling/...`` metrics: the ratio of the round's starting log-probs (``old``, else this step's own,
        detached: the same weights) to the sampler's, ``(B, T)`` in token modes and ``(B, 1)`` in sequence modes."""
        behaviour = batch.get(SAMPLING_LOGPS)
        if behaviour is None:
            return None, {}
        mask = batch["completion_mask"]
        start = logps.detach() if old is None else old
        ratio = sampling_importance_ratio(
            start, behaviour, mask, mode=self.mode, clip_min=self.clip_min, clip_max=self.clip_max
        )
        return ratio, sampling_metrics(start, behaviour, mask, ratio, self.mode)


class SamplerCheck:
    """The sampler check: the mean and largest ``|trainer log-prob - sampler log-prob|`` of a round's tokens under the
    same weights, over all ranks (``sampler_check/logp_gap_mean`` and ``_max``), with one warning (per module, over
    all its fits) when the mean passes ``threshold``.

    Args:
        threshold: the mean gap per token above which it warns (None: the check is off).
        sampler: what sampled, as the warning names it ("rollout worker", "vLLM engine").
    """

    def __init__(self, threshold: float | None, sampler: str) -> None:
        self.threshold = threshold
        self.sampler = sampler
        self.warned = False

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    def measure(
        self, module: Any, mine: Tensor, behaviour: Tensor, mask: Tensor, where: str, sampler: str | None = None
    ) -> dict[str, Tensor]:
        """The check of one round: ``mine`` and ``behaviour`` are ``(B, T)`` log-probs of the same tokens (the
        trainer's, the sampler's), ``mask`` the tokens to compare, ``where`` names the round and its weights in the
        warning, ``sampler`` what sampled this round if not the one given at construction. A collective under
        DDP/FSDP2: every rank calls it for every round. A round with no token to compare on any rank (every
        completion masked, ``mask_truncated_completions``) logs nothing rather than a gap of 0."""
        gap = (mine - behaviour).abs()[mask.bool()]
        stats = torch.stack([gap.sum(), torch.tensor(float(gap.numel()), device=gap.device)])
        largest = gap.max() if gap.numel() else torch.zeros((), device=gap.device)
        trainer = module.trainer
        if trainer.world_size > 1:
            stats = trainer.strategy.reduce(stats, reduce_op="sum")
            largest = module.all_gather(largest).max()
        total, count = stats.tolist()  # one host sync a round
        if count == 0:  # no token to compare on any rank (e.g. every completion masked): no figure
            return {}
        mean = stats[0] / stats[1]
        if not self.warned and total / count > self.threshold:
            self.warned = True
            rank_zero_warn(
                f"[lit_trainer] The {sampler or self.sampler}'s log-probs differ from the trainer's for the same "
                f"weights ({where}): mean |delta log p| = {total / count:.4g} > "
                f"sampler_check_threshold={self.threshold}, max {float(largest):.4g}. The sampler is not the policy "
                "being trained: a weight sync that did not reach it (e.g. LoRA adapters not loaded), or an engine "
                "with other numerics. Check the rollout_engine's weight loading; raise the threshold only if the gap "
                "is expected."
            )
        return {"sampler_check/logp_gap_mean": mean, "sampler_check/logp_gap_max": largest}
