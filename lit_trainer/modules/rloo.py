"""RLOOModule: REINFORCE Leave-One-Out (TRL 1.16 ``RLOOTrainer`` semantics), a sibling of GRPOModule.

Everything about rollouts is :class:`~lit_trainer.modules.online_rl.OnlineRLModule`'s: one batched generation per
``steps_per_generation`` micro-steps, reward functions and reward models (gathered over ranks), tools, environments
and ``rollout_func``, the seeded shuffle and buffer, exact resume in the middle of a round, DDP, LoRA, validation.
What RLOO changes (the math is in :mod:`lit_trainer.losses.rloo`):

* advantages: each completion's reward minus the mean reward of the other completions of its prompt
  (:func:`~lit_trainer.losses.rloo.rloo_advantages`), optionally whitened over the generation batch;
* the KL to the reference (``beta``, default 0.05 as the reference) is a reward penalty, summed per sequence from the
  generation-time log-probs, BEFORE the baseline; so a round computes the policy's and the reference's log-probs
  first, then the advantages (:meth:`RLOOModule._make_rollouts`);
* the loss is the sequence-level clipped surrogate averaged over the micro-batch's sequences
  (:func:`~lit_trainer.losses.rloo.rloo_policy_loss`); micro-batch means are averaged over the optimizer step's
  micro-batches and the ranks, as the reference's per-micro-batch loss divided by the accumulation steps (the base's
  default normaliser);
* rounds sampled by an engine with other numerics than the trainer's (``rollout_engine="vllm"``) keep the engine's
  log-probs: each sequence's loss is multiplied by the truncated or masked ratio of the trainer's log-probs to the
  engine's, and every round's gap between the two is checked
  (:mod:`lit_trainer.modules.online_rl._sampler`, shared with asynchronous GRPO).

GRPOModule's own options (its loss types, ``scale_rewards``, the entropy and off-policy options, asynchronous
rollouts, ...) are not RLOOModule's: passing one is an unexpected keyword.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, ClassVar, Literal, get_args

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import Self, override

from lit_trainer.data.prompt import PROMPTS
from lit_trainer.generation import engines as rollout
from lit_trainer.losses.grpo_advantages import grpo_reward_metrics, nanstd
from lit_trainer.losses.grpo_masks import check_sampling_is_options, masked_mean_entropy
from lit_trainer.losses.rloo import (
    check_clip_range,
    rloo_advantages,
    rloo_loss_metrics,
    rloo_policy_loss,
    rloo_rewards,
    sequence_logps,
)
from lit_trainer.modules.online_rl import OnlineRLModule
from lit_trainer.modules.online_rl._options import check_options
from lit_trainer.modules.online_rl._rollout_buffer import SAMPLING_LOGPS
from lit_trainer.modules.online_rl._sampler import SamplerCheck, SamplerCorrection

SequenceSamplingISMode = Literal["sequence_truncate", "sequence_mask"]
"""RLOO's sampler corrections: one ratio per sequence, as its policy ratio (GRPO's token modes do not apply)."""

_RETIRED_OPTIONS = {
    "loss_type": "grpo", "delta": None, "use_bias_correction_kl": True, "importance_sampling_level": "token",
    "scale_rewards": "group", "multi_objective_aggregation": "sum_then_normalize", "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0, "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2,
    "off_policy_mask_threshold": None, "max_staleness": None, "rollout_worker_device": None,
    "rollout_worker_threads": None,
}  # fmt: skip
"""GRPOModule's options that RLOOModule accepted at these values (it refused any other) while it was a subclass of
GRPOModule, and that its checkpoints and run records still list: ``loss_type="grpo"`` among the hyper-parameters, the
others in the CLI's ``config.yaml`` and run record. RLOOModule has no such options (the rollout engine's and the
sampler correction's, which it listed at their defaults too, are its own options again); these are dropped when such a
checkpoint is loaded (``RLOOModule.load_from_checkpoint``) and not counted as a change of configuration when
``--ckpt_path last`` looks for the run to continue (:attr:`RLOOModule.RETIRED_OPTIONS`)."""


_LOADING_CHECKPOINT: ContextVar[bool] = ContextVar("rloo_loading_checkpoint", default=False)


class RLOOModule(OnlineRLModule):
    """REINFORCE Leave-One-Out (TRL 1.16 ``RLOOTrainer``) as a LightningModule, on the online-RL base's rollouts.

    Use it with a :class:`~lit_trainer.data.prompt.PromptDataModule` exactly as :class:`GRPOModule`.

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel``.
        reward_funcs: as :class:`~lit_trainer.modules.online_rl.OnlineRLModule` (functions, import paths, reward
            models).
        reward_weights: one weight per function (default all 1.0).
        num_generations: completions per prompt ``G`` (>= 2; the reference's default 2).
        steps_per_generation: micro-steps served by one generation (default: ``accumulate_grad_batches``).
        generation_batch_size: completions per generation over all ranks (exclusive with the above).
        num_iterations: passes over each generation batch (> 1 stores the generation-time log-probs).
        max_completion_length: new-token budget per completion.
        temperature: sampling temperature (log-probs use logits divided by it, as the reference).
        mask_truncated_completions: drop completions without EOS from the loss and the KL (their rewards still count
            in the baselines).
        epsilon: lower clip of the sequence ratio; also the upper one when ``epsilon_high`` is None.
        epsilon_high: upper clip.
        beta: KL coefficient: ``r - beta * sum_t (log pi_old - log pi_ref)`` per completion, before the baseline.
            != 0 keeps a frozen reference (a copy of the initial policy; with ``peft_config`` the policy with its
            adapters disabled). The reference's default 0.05.
        normalize_advantages: whiten the advantages over the whole generation batch (all ranks).
        reward_clip_range: ``(low, high)`` clip of the weighted reward (before the KL); None = off.
        rollout_engine: what samples the rounds, in this process: None (transformers' ``generate``, or its continuous
            batching when asked), ``"vllm"`` (:class:`~lit_trainer.generation.vllm.VLLMEngine`, a vLLM server per
            rank; docs/vllm.md), or the import path of a :class:`~lit_trainer.generation.RolloutEngine` subclass.
        rollout_engine_options: keyword arguments of that engine's class (vLLM: ``python``, ``dtype``,
            ``max_model_len``, ``threads``, ...).
        rollout_importance_sampling_correction: multiply the loss of each sequence sampled by an engine with other
            numerics than the trainer's (vLLM) by the ratio ``exp(sum_t (old - engine))`` of the trainer's log-probs
            to the engine's, truncated or masked as ``rollout_importance_sampling_mode`` says (TRL's
            ``vllm_importance_sampling_correction``, per sequence as RLOO's ratio).
        rollout_importance_sampling_mode: "sequence_mask" (a ratio outside the bounds drops the sequence) or
            "sequence_truncate" (clamped to the bounds).
        rollout_importance_sampling_clip_max: upper bound of that ratio (None = unbounded).
        rollout_importance_sampling_clip_min: lower bound (None = unbounded below).
        sampler_check_threshold: every round of such an engine, its log-probs are compared with the trainer's on
            the same weights (``sampler_check/logp_gap_mean`` and ``_max``); a mean gap per token above this warns
            once. None skips the check.
        learning_rate: peak learning rate (the reference's default 1e-6).
        **kwargs: the other :class:`~lit_trainer.modules.online_rl.OnlineRLModule` options (sampling: ``top_p``,
            ``top_k``, ``min_p``, ``repetition_penalty``, ``generation_kwargs``, ``cache_implementation``, continuous
            batching; reward models: ``reward_processing_classes``, ``reward_model_batch_size``,
            ``reward_model_inputs``; ``sync_ref_model`` and its two options; logging: ``log_completions``,
            ``num_completions_to_print``, ``log_unique_prompts``; ``tools``, ``environment_factory``,
            ``max_tool_calling_iterations``, ``rollout_func``, ``chat_template_kwargs``, ``eval_do_sample``,
            ``generation_seed``) and :class:`~lit_trainer.modules.base.BaseModule`'s optimizer options.

    Raises:
        TypeError: on an option that is not RLOO's (e.g. GRPOModule's ``loss_type`` or ``scale_rewards``).
        ValueError: on a bad ``reward_clip_range``, ``epsilon`` or sampler-correction option (a token mode), or any
            :class:`~lit_trainer.modules.online_rl.OnlineRLModule` validation error.

    Example::

        module = RLOOModule("tiny", reward_funcs=[arithmetic_reward], num_generations=8, temperature=0.7,
                            max_completion_length=8, beta=0.0, learning_rate=1e-4)
        lightning.Trainer(max_steps=200).fit(module, datamodule=PromptDataModule(batch_size=64, max_length=16))
    """

    RUN_NAME: ClassVar[str] = "rloo"  # the run folder `lit-trainer fit` uses without --run_name
    #: options earlier versions took, at the only value they accepted (read by the run identity check)
    RETIRED_OPTIONS: ClassVar[dict[str, Any]] = _RETIRED_OPTIONS

    def __init__(
        self,
        model: Any = "tiny",
        *,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any],
        reward_weights: Sequence[float] | None = None,
        num_generations: int = 2,
        steps_per_generation: int | None = None,
        generation_batch_size: int | None = None,
        num_iterations: int = 1,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        mask_truncated_completions: bool = False,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.05,
        normalize_advantages: bool = False,
        reward_clip_range: tuple[float, float] | None = None,
        rollout_engine: str | None = None,
        rollout_engine_options: dict[str, Any] | None = None,
        rollout_importance_sampling_correction: bool = True,
        rollout_importance_sampling_mode: SequenceSamplingISMode = "sequence_mask",
        rollout_importance_sampling_clip_max: float | None = 3.0,
        rollout_importance_sampling_clip_min: float | None = None,
        sampler_check_threshold: float | None = 0.05,
        learning_rate: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        if _LOADING_CHECKPOINT.get():  # a checkpoint of the former RLOOModule (a GRPOModule) lists these options
            for name in _RETIRED_OPTIONS.keys() & kwargs.keys():
                kwargs.pop(name)
        elif grpo_only := sorted(_RETIRED_OPTIONS.keys() & kwargs.keys()):
            raise TypeError(
                f"RLOOModule() got GRPOModule's option(s) {', '.join(grpo_only)}, which RLOO does not have (its loss "
                "and advantages are its own, and it samples in the training process). Use GRPOModule for them, or "
                "drop them."
            )
        check_options(
            {
                "epsilon": epsilon, "epsilon_high": epsilon_high, "sampler_check_threshold": sampler_check_threshold,
                "rollout_importance_sampling_clip_max": rollout_importance_sampling_clip_max,
                "rollout_importance_sampling_clip_min": rollout_importance_sampling_clip_min,
            },
            type(self).__name__,
        )  # fmt: skip
        check_clip_range(reward_clip_range)
        sampler_options = {
            "rollout_importance_sampling_correction": rollout_importance_sampling_correction,
            "rollout_importance_sampling_mode": rollout_importance_sampling_mode,
            "rollout_importance_sampling_clip_max": rollout_importance_sampling_clip_max,
            "rollout_importance_sampling_clip_min": rollout_importance_sampling_clip_min,
            "sampler_check_threshold": sampler_check_threshold,
        }
        _check_sampler_correction(sampler_options, rollout_engine)
        super().__init__(
            model,
            reward_funcs=reward_funcs,
            reward_weights=reward_weights,
            num_generations=num_generations,
            steps_per_generation=steps_per_generation,
            generation_batch_size=generation_batch_size,
            num_iterations=num_iterations,
            max_completion_length=max_completion_length,
            temperature=temperature,
            mask_truncated_completions=mask_truncated_completions,
            beta=beta,
            learning_rate=learning_rate,
            **kwargs,
        )
        self.hparams["reward_clip_range"] = None if reward_clip_range is None else tuple(reward_clip_range)
        self.sampler_correction = SamplerCorrection.from_hparams(self.hparams)
        self.sampler_check = SamplerCheck(sampler_check_threshold, type(self.engine).__name__)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Self:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``; a checkpoint written while RLOOModule was a GRPOModule subclass
        loads too (its :attr:`RETIRED_OPTIONS` hyper-parameters, which no longer exist, are dropped)."""
        token = _LOADING_CHECKPOINT.set(True)
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        finally:
            _LOADING_CHECKPOINT.reset(token)

    # ------------------------------------------------------------------------------------------------ rollouts
    @override
    @torch.no_grad()
    def _make_rollouts(self, batch: dict[str, Any], can_stop: bool = False, position: tuple[int, int] = (0, 0)) -> None:
        """One round: the log-probs come before the advantages, since RLOO's KL is a reward term. Always sampled in
        this process (``position`` is unused: RLOO has no asynchronous worker).

        Generation-time log-probs are computed when the KL needs them (``beta != 0``) and stored only when the round
        is used across optimizer steps; the reference's are used for the KL and not stored (the loss has no KL term).
        A round sampled by an engine with its own numerics (vLLM) keeps the engine's log-probs for the correction and
        is checked against the trainer's (:meth:`_sampler_terms`).
        """
        hp = self.hparams
        rows, completions, scoring_batch, decoded, tool_metrics = self._generate_rows(batch, can_stop)
        stored = self._stores_old_logps()
        old = self._chunked_logps(self.model, rows) if stored or hp.beta != 0 else None
        kl_tokens = None
        if hp.beta != 0:
            kl_tokens = self._chunked_logps(self.ref_model, rows)
            kl_tokens = old - kl_tokens  # first-order per-token estimate log pi_old - log pi_ref (may be < 0)
        advantages, metrics = self._score(scoring_batch, completions, decoded, kl_tokens=kl_tokens, rows=rows)
        metrics.update(tool_metrics)
        rows["advantages"] = advantages
        if stored:
            rows["old_logps"] = old
        behaviour = self._engine_logps(rows, completions, decoded)
        if behaviour is not None:
            metrics.update(self._sampler_terms(rows, behaviour, old))
        self._buffer_round(rows, metrics)

    def _sampler_terms(self, rows: dict[str, Tensor], behaviour: Tensor, old: Tensor | None) -> dict[str, Tensor]:
        """The engine's log-probs of a round (in place: ``sampling_logps`` when the correction is on) and the sampler
        check: the trainer's log-probs of the same tokens on the same weights, ``old`` when the round computed them
        (every row, no extra forward), else of the first prompt group's rows."""
        if self.sampler_correction.enabled:
            rows[SAMPLING_LOGPS] = behaviour
        if not self.sampler_check.enabled:
            return {}
        mask = rows["completion_mask"]
        if old is None:
            size = self.hparams.num_generations
            first = {k: v[:size] for k, v in rows.items() if isinstance(v, Tensor) and v.dim() >= 1}
            old, behaviour, mask = self.completion_logps(self.model, first)[0], behaviour[:size], mask[:size]
        where = f"round {self._buffer.next_round_index}"
        return self.sampler_check.measure(self, old, behaviour, mask, where)

    def _score(
        self,
        batch: dict[str, Any],
        completions: rollout.Completions,
        decoded: tuple | None = None,
        *,
        kl_tokens: Tensor | None = None,
        rows: dict[str, Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Rewards of this rank's rows, gathered over ranks with the per-sequence KL -> (this rank's leave-one-out
        advantages, the round's metrics: GRPO's reward and length metrics, ``frac_reward_zero_std`` of the clipped,
        KL-penalised reward, and ``kl``, the token mean of ``log pi_old - log pi_ref`` over all ranks)."""
        hp = self.hparams
        extra = []
        if kl_tokens is not None:
            mask = rows["completion_mask"]
            extra = [sequence_logps(kl_tokens, mask).unsqueeze(1), mask.sum(1, keepdim=True).to(kl_tokens)]
        table, functions, texts, logged = self._gathered_scores(batch, completions, decoded, extra)
        all_rewards, all_lengths = table[:, :functions], table[:, functions]
        all_truncated = table[:, functions + 1].bool()
        kl = table[:, functions + 2] if kl_tokens is not None else None
        options = {"reward_weights": self.reward_weights, "reward_clip_range": hp.reward_clip_range}
        options.update(kl=kl, beta=hp.beta)
        advantages = rloo_advantages(
            all_rewards, hp.num_generations, normalize_advantages=hp.normalize_advantages, **options
        )
        metrics = grpo_reward_metrics(
            all_rewards, hp.num_generations, reward_weights=self.reward_weights, reward_names=self.reward_names
        )
        penalised = rloo_rewards(all_rewards, **options).reshape(-1, hp.num_generations)
        std = nanstd(penalised, dim=1)
        metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).to(std.dtype).mean()
        if kl is not None:
            metrics["kl"] = kl.sum() / table[:, functions + 3].sum().clamp(min=1.0)
        metrics.update(rollout.completion_metrics(all_lengths, all_truncated))
        metrics.update(logged)
        if hp.log_completions:
            self._record_completions(batch[PROMPTS], texts, all_rewards, advantages)
        local = len(texts)
        return advantages[self.global_rank * local : (self.global_rank + 1) * local], metrics

    # ---------------------------------------------------------------------------------------------------- loss
    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Sequence-level clipped loss of one buffered micro-batch (mean over its rows), its clip metrics and the
        mean token entropy. ``num_items_in_batch`` is always None (a per-micro-batch mean, as the reference)."""
        hp = self.hparams
        logps, entropy = self.completion_logps(self.model, batch, with_entropy=True)
        mask, old, advantages = batch["completion_mask"], batch.get("old_logps"), batch["advantages"]
        clip = {"epsilon": hp.epsilon, "epsilon_high": hp.epsilon_high}
        ratio, sampling = self.sampler_correction.ratio(batch, logps, old)  # rounds of an engine with other numerics
        loss = rloo_policy_loss(logps, old, advantages, mask, importance_sampling_ratio=ratio, **clip)
        metrics = rloo_loss_metrics(logps, old, advantages, mask, **clip)
        metrics.update(sampling)
        metrics["entropy"] = masked_mean_entropy(entropy.detach(), mask)
        return loss, metrics


def _check_sampler_correction(options: dict[str, Any], engine: str | None) -> None:
    """RLOO's sampler-correction options: a sequence mode with valid bounds; set away from their defaults without an
    engine of its own numerics, they do nothing (warned)."""
    mode = options["rollout_importance_sampling_mode"]
    if mode not in get_args(SequenceSamplingISMode):
        why = (
            "RLOO's policy ratio is one per sequence, and so is the correction of an engine's rounds"
            if mode in ("token_truncate", "token_mask")
            else "not a mode"
        )
        raise ValueError(
            f"`RLOOModule(rollout_importance_sampling_mode={mode!r})` is invalid ({why}): choose one of "
            f"{get_args(SequenceSamplingISMode)}."
        )
    if options["rollout_importance_sampling_correction"]:
        check_sampling_is_options(
            mode, options["rollout_importance_sampling_clip_min"], options["rollout_importance_sampling_clip_max"]
        )
    defaults = inspect.signature(RLOOModule.__init__).parameters
    changed = {k: v for k, v in options.items() if v != defaults[k].default}
    if engine is None and changed:
        rank_zero_warn(
            f"RLOOModule({', '.join(f'{k}={v!r}' for k, v in changed.items())}) has no effect without "
            "rollout_engine: these options correct and check the rounds of an engine with its own numerics (vLLM), "
            "and transformers' rounds are exactly on-policy. Set rollout_engine='vllm', or leave them at their "
            "defaults.",
            category=UserWarning,
        )
