"""GRPOModule: online RL with group-relative advantages, on :class:`~lit_trainer.modules.online_rl.OnlineRLModule`.

The rollouts, rewards, round buffer, exact resume, tools, images, reference model and validation are the base's (its
module docstring gives the data flow, docs/design.md#trl-grpo). What GRPO adds: its advantages (group-relative,
``scale_rewards``, ``multi_objective_aggregation``), the loss types with their options (clipping, ``delta``, SAPO,
VESPO, GSPO's sequence-level ratio), the entropy options (high-entropy token mask, entropy bonus), the off-policy
sequence mask, and asynchronous rollouts (``self.async_rollouts``, an
:class:`~lit_trainer.modules.grpo._async.AsyncRollouts` its hooks call).

Normalisation (overrides the base's per-micro-batch mean, :meth:`GRPOModule._num_items`).
``dapo``/``cispo``/``vespo`` divide the masked token-loss sum by the completion tokens of the optimizer step over all
ranks, after truncation masking, so the step gradient equals the full-batch token-mean gradient on its rollouts for any
``steps_per_generation`` and ``accumulate_grad_batches``: when the step's micro-batches are all in the buffer the
count is exact from the start; when the step reaches into the next generation round, a provisional count is
corrected at the step's last micro-batch (:mod:`lit_trainer.modules.grpo._normaliser`; the reference keeps its
approximate ``N * GA_cur / steps_per_generation``). The other loss types are per-micro-batch means as in the
reference, averaged over the step's micro-batches and the ranks. A checkpoint written inside an optimizer step
resumes exactly: the resumed step's token normaliser counts the micro-batches run before the checkpoint, which are in
the buffer, unless the step began in the previous generation round (then only its remaining micro-batches are
counted).

Images: asynchronous rollouts do not carry them yet (refused at setup, with the base's refusals).

This file holds GRPO's options, its round (advantages, then the old/reference log-probs), the training-step
normaliser and entropy bonus, and the policy loss. Its private parts are beside it in this package: the entropy control
(``_entropy``), the step normaliser (``_normaliser``), asynchronous rollouts (``_async``); the shared rollout pieces
(``_rollouts``, ``_reward_calls``, ``_rollout_buffer``, ``_completion_table``, ``_options``) are used by the base too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch import Callback
from torch import Tensor
from typing_extensions import override

from lit_trainer.core import sharding as _sharding
from lit_trainer.core.dist import gather_from_all_ranks
from lit_trainer.data.prompt import PROMPTS
from lit_trainer.generation import engines as rollout
from lit_trainer.losses.grpo import grpo_loss_metrics, grpo_policy_loss
from lit_trainer.losses.grpo_advantages import Aggregation, ScaleRewards, grpo_advantages, grpo_reward_metrics
from lit_trainer.losses.grpo_masks import SamplingISMode, high_entropy_mask, masked_mean_entropy, off_policy_mask
from lit_trainer.losses.grpo_options import GRPO_LOSS_DEFAULTS, ImportanceSamplingLevel, LossType
from lit_trainer.modules.grpo._async import STATE_KEY as _ASYNC_KEY
from lit_trainer.modules.grpo._async import AsyncOptions, AsyncRollouts
from lit_trainer.modules.grpo._entropy import EntropyControl, gather_entropy_pool
from lit_trainer.modules.grpo._normaliser import StepNormaliser
from lit_trainer.modules.online_rl import OnlineRLModule
from lit_trainer.modules.online_rl._logps import CompletionScorer
from lit_trainer.modules.online_rl._options import CacheImplementation, check_options
from lit_trainer.modules.online_rl._rollout_buffer import SAMPLING_LOGPS
from lit_trainer.rewards import RewardModelInputs

_ENTROPY_KEY = "grpo_entropy_control"
_TOKEN_NORMALISED = ("dapo", "cispo", "vespo")


__all__ = ["GRPOModule"]


class GRPOModule(OnlineRLModule):
    """Group Relative Policy Optimization (TRL 1.16 ``GRPOTrainer`` semantics) as a LightningModule.

    Use it with a :class:`~lit_trainer.data.prompt.PromptDataModule`, whose ``batch_size`` is the reference's
    ``per_device_train_batch_size`` (completions per micro-batch per rank). The arguments not listed here (the model,
    reward functions and models, rollout geometry and sampling, ``mask_truncated_completions``, ``eval_do_sample``, the
    reference's ``sync_ref_model`` options, completion logging, the generation engine, tools, environments,
    ``rollout_func``, ``chat_template_kwargs``, ``generation_seed``, ``learning_rate``) are
    :class:`~lit_trainer.modules.online_rl.OnlineRLModule`'s, with the same defaults (TRL's ``GRPOConfig``).

    Args:
        loss_type: grpo, bnpo, dr_grpo, dapo (default), cispo, sapo, luspo, vespo.
        epsilon: lower clip; also the upper one when ``epsilon_high`` is None.
        epsilon_high: upper clip (and the CISPO cap).
        delta: two-sided cap of the unclipped ratio (> 1), None = off.
        beta: KL coefficient of the loss's ``beta * KL(policy || reference)`` term (the reference: see
            :class:`~lit_trainer.modules.online_rl.OnlineRLModule`).
        use_bias_correction_kl: weight the k3 KL by the per-token ratio.
        importance_sampling_level: "token" or "sequence" (GSPO).
        scale_rewards: "group", "batch" or "none".
        multi_objective_aggregation: "sum_then_normalize" or "normalize_then_sum" (GDPO).
        sapo_temperature_pos: SAPO temperature for positive advantages.
        sapo_temperature_neg: SAPO temperature for non-positive advantages.
        vespo_k_pos: VESPO gamma-weight exponent ``k`` for advantages >= 0.
        vespo_lambda_pos: VESPO rate ``lambda`` for advantages >= 0.
        vespo_k_neg: VESPO ``k`` for negative advantages.
        vespo_lambda_neg: VESPO ``lambda`` for negative advantages.
        top_entropy_quantile: ``ρ``: train the policy term on the tokens whose entropy is in the top ``ρ`` fraction
            (threshold: the ``1 − ρ`` quantile of the masked entropies of every rank's micro-batch); 1.0 = all tokens.
        entropy_coef: entropy bonus: the loss becomes ``policy − c * H`` with ``H`` the mean token entropy (with
            gradient) of the trained tokens, the same for every loss type (see
            :mod:`lit_trainer.modules.grpo._entropy`); 0.0 = off. With ``use_adaptive_entropy``, the starting value.
        use_adaptive_entropy: Skywork-OR1's adaptive coefficient: after each optimizer step it moves by
            ``entropy_coef_delta`` (up while the step's entropy over all ranks is <= ``entropy_target``, else down),
            and it is applied only while that entropy is <= ``entropy_target``. Checkpointed: resume is exact.
        entropy_coef_min: lower bound of the adaptive coefficient.
        entropy_coef_max: upper bound of the adaptive coefficient.
        entropy_coef_delta: step of the adaptive coefficient.
        entropy_target: target mean token entropy in nats (the logged ``entropy`` early in training is a good start).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask: a sequence with a negative advantage is
            dropped from the policy term when its mean ``sampling − logp`` exceeds this (e.g. 0.5); None = off.
            ``sampling`` is the rollout worker's log-prob on a round with the importance-sampling correction (TRL's
            vLLM log-prob), else ``old`` (the current log-prob, detached, when the round stores none).
        max_staleness: asynchronous rollouts: a worker process per rank (its own copy of the policy) samples the next
            rounds while this one trains, round ``q`` with the weights of round ``q - max_staleness`` (the worker
            waits for them: no round is ever staler, none is dropped). 0 runs the synchronous computation in the
            worker, bit-exact; 1 overlaps each round's generation with the previous round's training. None (default)
            samples in the training process. A resume is exact at any value: the checkpoint keeps the weights
            versions the rounds in flight are sampled by (up to ``max_staleness`` copies of the trainable weights).
            See :mod:`lit_trainer.modules.grpo._async` and docs/grpo_async.md.
        rollout_worker_device: the worker's device (``"cpu"``, ``"cuda:1"``); None = this rank's device.
        rollout_worker_threads: the worker's CPU threads (``torch.set_num_threads``); None = the trainer's count.
        rollout_engine: ``"vllm"`` (:class:`~lit_trainer.generation.vllm.VLLMEngine`, docs/vllm.md) or the import
            path of a :class:`~lit_trainer.generation.RolloutEngine` subclass that samples the rounds: in the rollout
            worker with ``max_staleness``, else in this process (None: ``generate``, or continuous batching when
            asked). The rounds of an engine with its own numerics (vLLM) are corrected and checked either way.
        rollout_engine_options: keyword arguments of that engine's class (vLLM: ``python``, ``dtype``,
            ``max_model_len``, ``kv_cache_gib``, ...).
        rollout_importance_sampling_correction: correct stale rounds (and every round of an engine with other
            numerics) by the ratio ``exp(old - behaviour)`` of the trainer's log-probs at the round's start to the
            sampler's, truncated or masked as ``rollout_importance_sampling_mode`` says (TRL's
            ``vllm_importance_sampling_correction``).
        rollout_importance_sampling_mode: "token_truncate", "token_mask", "sequence_truncate" or "sequence_mask"
            (TRL's ``vllm_importance_sampling_mode``, default "sequence_mask").
        rollout_importance_sampling_clip_max: upper bound of the ratio (TRL's ``..._clip_max``, formerly ``_cap``).
        rollout_importance_sampling_clip_min: lower bound of the ratio (None = unbounded below).
        sampler_check_threshold: every round of the worker (or of an engine with other numerics), the sampler's
            log-probs are compared with the trainer's for the same weights version (``sampler_check/logp_gap_mean``
            and ``_max``); a mean absolute gap above this warns once (a weight sync that did not reach the sampler).
            None skips the check and its forward pass.
        **kwargs: optimizer, scheduler and clipping options of :class:`~lit_trainer.modules.base.BaseModule`.

    Raises:
        ValueError: on any invalid option (:func:`~lit_trainer.modules.online_rl._options.check_options`), a bad reward
            function or weight count, ``sync_ref_model`` with ``beta=0`` or a peft-wrapped policy; at setup, on a
            batch geometry the reference rejects (the message gives a valid one), the entropy bonus on a step whose
            gradient is rescaled at its end, or continuous batching under sharding.

    Example::

        module = GRPOModule("tiny", reward_funcs=[arithmetic_reward], num_generations=8, temperature=0.7,
                            max_completion_length=8, learning_rate=1e-4)
        trainer = lightning.Trainer(max_steps=200, accumulate_grad_batches=1)
        trainer.fit(module, datamodule=PromptDataModule(batch_size=64, max_length=16))
    """

    RUN_NAME: ClassVar[str] = "grpo"  # the run folder `lit-trainer fit` uses without --run_name

    def __init__(
        self,
        model: Any = "tiny",
        *,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any],
        reward_weights: Sequence[float] | None = None,
        reward_processing_classes: Sequence[Any] | Any = None,
        reward_model_batch_size: int | None = None,
        reward_model_inputs: RewardModelInputs = "as_trained",
        num_generations: int = 8,
        steps_per_generation: int | None = None,
        generation_batch_size: int | None = None,
        num_iterations: int = 1,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        mask_truncated_completions: bool = False,
        eval_do_sample: bool = False,
        loss_type: LossType = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        beta: float = 0.0,
        use_bias_correction_kl: bool = True,
        importance_sampling_level: ImportanceSamplingLevel = "token",
        scale_rewards: ScaleRewards = "group",
        multi_objective_aggregation: Aggregation = "sum_then_normalize",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
        top_entropy_quantile: float = 1.0,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        entropy_target: float = 0.2,
        off_policy_mask_threshold: float | None = None,
        log_completions: bool = False,
        num_completions_to_print: int | None = None,
        log_unique_prompts: bool = False,
        cache_implementation: CacheImplementation | None = None,
        use_transformers_continuous_batching: bool = False,
        transformers_continuous_batching_config: dict[str, Any] | None = None,
        use_transformers_paged: bool = False,
        tools: Sequence[str | Callable[..., Any]] | None = None,
        environment_factory: Any = None,
        max_tool_calling_iterations: int | None = None,
        rollout_func: str | Callable[..., Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_staleness: int | None = None,
        rollout_worker_device: str | None = None,
        rollout_worker_threads: int | None = None,
        rollout_engine: str | None = None,
        rollout_engine_options: dict[str, Any] | None = None,
        rollout_importance_sampling_correction: bool = True,
        rollout_importance_sampling_mode: SamplingISMode = "sequence_mask",
        rollout_importance_sampling_clip_max: float | None = 3.0,
        rollout_importance_sampling_clip_min: float | None = None,
        sampler_check_threshold: float | None = 0.05,
        generation_seed: int | None = None,
        learning_rate: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        # every option here (the base checks its own again): the first invalid one is reported, in the table's order
        check_options({k: v for k, v in locals().items() if k not in ("self", "kwargs")}, type(self).__name__)
        super().__init__(
            model,
            reward_funcs=reward_funcs,
            reward_weights=reward_weights,
            reward_processing_classes=reward_processing_classes,
            reward_model_batch_size=reward_model_batch_size,
            reward_model_inputs=reward_model_inputs,
            num_generations=num_generations,
            steps_per_generation=steps_per_generation,
            generation_batch_size=generation_batch_size,
            num_iterations=num_iterations,
            max_completion_length=max_completion_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            generation_kwargs=generation_kwargs,
            mask_truncated_completions=mask_truncated_completions,
            eval_do_sample=eval_do_sample,
            beta=beta,
            sync_ref_model=sync_ref_model,
            ref_model_mixup_alpha=ref_model_mixup_alpha,
            ref_model_sync_steps=ref_model_sync_steps,
            log_completions=log_completions,
            num_completions_to_print=num_completions_to_print,
            log_unique_prompts=log_unique_prompts,
            cache_implementation=cache_implementation,
            use_transformers_continuous_batching=use_transformers_continuous_batching,
            transformers_continuous_batching_config=transformers_continuous_batching_config,
            use_transformers_paged=use_transformers_paged,
            tools=tools,
            environment_factory=environment_factory,
            max_tool_calling_iterations=max_tool_calling_iterations,
            rollout_func=rollout_func,
            chat_template_kwargs=chat_template_kwargs,
            generation_seed=generation_seed,
            learning_rate=learning_rate,
            **kwargs,
        )
        self._entropy = EntropyControl(
            entropy_coef, use_adaptive_entropy, entropy_target, entropy_coef_delta, entropy_coef_min, entropy_coef_max
        )
        self._restored_entropy: dict[str, Any] | None = None
        self._normaliser: StepNormaliser | None = None
        self.async_rollouts = AsyncRollouts(AsyncOptions.from_hparams(self.hparams))  # inactive without max_staleness
        # corrected rounds: stale ones of the worker, and every round of an engine with its own numerics (vLLM)
        mode = rollout_importance_sampling_mode
        corrected = rollout_importance_sampling_correction and (
            max_staleness is not None or not self.engine.same_numerics
        )
        if loss_type == "vespo" and corrected and mode.startswith("sequence"):
            raise ValueError(
                f"`GRPOModule(loss_type='vespo', rollout_importance_sampling_mode={mode!r})` with "
                f"max_staleness={max_staleness!r}, rollout_engine={rollout_engine!r}: VESPO folds a per-token ratio "
                "into its weights (as TRL); use 'token_truncate' or 'token_mask'."
            )

    def behaviour_scorer(self) -> Callable[[Any, dict[str, Tensor]], Tensor]:
        """The forward the rollout worker runs for the behaviour log-probs of its rounds: ``scorer(model, rows)`` ->
        ``(B, C)`` per-token log-probs of the rows' completion tokens, as ``completion_logps(model, rows)[0]``
        computes them in the trainer (the sampler check compares the two). It is pickled to the worker process, so it
        must be picklable and its class importable there (a top-level class or function, not a lambda or a class
        defined in a notebook). Override it together with ``completion_logps`` (or ``score_tokens``); the default is
        :func:`~lit_trainer.modules.online_rl._logps.completion_logps` with the temperature and the ``chunked_logits``
        options, as this module runs it."""
        hp = self.hparams
        return CompletionScorer(hp.temperature, hp.get("chunked_logits", "auto"), hp.get("logits_chunk_size"))

    # ------------------------------------------------------------------------------------------------ lifecycle
    @override
    def configure_callbacks(self) -> list[Callback]:
        return [*super().configure_callbacks(), *self.async_rollouts.callbacks()]

    @override
    def configure_model(self) -> None:
        self.async_rollouts.copy_before_sharding(self.model, self.device_mesh)
        super().configure_model()

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            self.async_rollouts.check(type(self).__name__, self.rollout_func, self.is_quantized)

    @override
    def _image_refusals(self) -> dict[str, tuple[bool, str]]:
        max_staleness = (self.hparams.max_staleness is not None, "the rollout worker is sent prompt ids only")
        return {"max_staleness": max_staleness, **super()._image_refusals()}

    @override
    def _check_geometry(self, spg: int) -> None:
        """Refuse what cannot be exact with this ``steps_per_generation`` and strategy (the fix in the message): the
        token normaliser's correction and the entropy bonus, then the base's checks."""
        hp, accumulate = self.hparams, self.trainer.accumulate_grad_batches
        strategy, name = type(self.trainer.strategy).__name__, type(self).__name__
        corrected = hp.loss_type in _TOKEN_NORMALISED and spg % accumulate
        if corrected and not _sharding.has_local_grads(self.trainer.strategy):
            raise ValueError(
                f"{name}(loss_type={hp.loss_type!r}) with steps_per_generation={spg} not a multiple of "
                f"accumulate_grad_batches={accumulate} corrects the step's "
                f"gradient in `param.grad`, which {strategy} does not use: use strategy 'ddp', or make "
                "steps_per_generation a multiple of accumulate_grad_batches."
            )
        if corrected and self._entropy.enabled:
            raise ValueError(
                f"{name}(entropy_coef={hp.entropy_coef}, use_adaptive_entropy={hp.use_adaptive_entropy}) with "
                f"loss_type={hp.loss_type!r} and steps_per_generation={spg} not a multiple of "
                f"accumulate_grad_batches={accumulate}: the step's token normaliser is corrected by rescaling the "
                "whole gradient, entropy bonus included. Make steps_per_generation a multiple of "
                "accumulate_grad_batches, or turn the entropy bonus off."
            )
        super()._check_geometry(spg)

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._apply_restored_entropy()
        self.async_rollouts.start(self)

    def _apply_restored_entropy(self) -> None:
        """Restore a loaded checkpoint's entropy control once fitting has started and the checkpoint is loaded
        (either order: see :meth:`OnlineRLModule._apply_restored`)."""
        if not self._fit_started or self._restored_entropy is None:
            return
        state, self._restored_entropy = self._restored_entropy, None
        windows = state["windows"]  # another world size: the interrupted step's entropy window starts empty
        window = windows[self.global_rank] if len(windows) == self.trainer.world_size else None
        self._entropy.load_state_dict({**state, "window": window}, self.device)

    @override
    def teardown(self, stage: str) -> None:
        self.async_rollouts.close()
        super().teardown(stage)  # the module's own engine (vLLM sampling here), if one started

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._entropy.enabled:
            state = self._entropy.state_dict()
            windows = gather_from_all_ranks(state.pop("window"))  # a collective under DDP
            checkpoint[_ENTROPY_KEY] = {**state, "windows": windows}
        if self._buffer is not None:  # the weights versions the rounds in flight were sampled by (no collective)
            state = self.async_rollouts.state_dict(self._buffer.rounds)
            if state is not None:
                checkpoint[_ASYNC_KEY] = state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._restored_entropy = checkpoint.get(_ENTROPY_KEY)
        self._apply_restored_entropy()
        if self.async_rollouts.enabled:
            self.async_rollouts.load_state_dict(checkpoint.get(_ASYNC_KEY))

    # ------------------------------------------------------------------------------------------------ rollouts
    @override
    @torch.no_grad()
    def _make_rollouts(self, batch: dict[str, Any], can_stop: bool = False, position: tuple[int, int] = (0, 0)) -> None:
        """Generate, score (GRPO's advantages first), add the old/reference log-probs and buffer one round.

        ``can_stop``: the round starts an optimizer step (nothing of the step is applied yet), so a stop request (a
        signal, :mod:`lit_trainer.core.stop_request`) may end its generation early; the ranks then agree, right after
        generating, whether to drop the round and save the last finished step (the callback raises) or go on.
        ``position``: ``(epoch, batch index)`` of the round's first micro-step (where the rollout worker of an
        asynchronous run reads the next rounds' prompts from, :mod:`lit_trainer.modules.grpo._async`).
        """
        if self.async_rollouts.worker is not None:
            rows, completions, scoring_batch, decoded, tool_metrics, behaviour, staleness = self.async_rollouts.rows(
                self, batch, can_stop, position
            )
        else:
            rows, completions, scoring_batch, decoded, tool_metrics = self._generate_rows(batch, can_stop)
            behaviour, staleness = self._engine_logps(rows, completions, decoded), 0  # vLLM in this process
        advantages, metrics = self._score(scoring_batch, completions, decoded)
        metrics.update(tool_metrics)
        rows["advantages"] = advantages
        if behaviour is not None:
            self.async_rollouts.off_policy_terms(self, rows, behaviour, staleness, metrics)
        elif self._stores_old_logps():
            rows["old_logps"] = self._chunked_logps(self.model, rows)
        if self.ref_model is not None:
            rows["ref_logps"] = self._chunked_logps(self.ref_model, rows)
        self._buffer_round(rows, metrics)

    def _score(
        self, batch: dict[str, Any], completions: rollout.Completions, decoded: tuple | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Rewards of this rank's rows, gathered over ranks -> (this rank's advantages, generation metrics).

        ``decoded``: ``(texts, kept ids, extra reward keywords)`` of an agentic round (else decoded here); the length
        metrics count ``completions.mask``, the model's tokens."""
        hp = self.hparams
        table, functions, texts, logged = self._gathered_scores(batch, completions, decoded)
        all_rewards, all_lengths = table[:, :functions], table[:, functions]
        all_truncated = table[:, functions + 1].bool()
        scoring = {"reward_weights": self.reward_weights, "scale_rewards": hp.scale_rewards}  # shared by both calls
        advantages = grpo_advantages(
            all_rewards, hp.num_generations, aggregation=hp.multi_objective_aggregation, **scoring
        )
        rows = len(texts)
        metrics = grpo_reward_metrics(all_rewards, hp.num_generations, reward_names=self.reward_names, **scoring)
        metrics.update(rollout.completion_metrics(all_lengths, all_truncated))
        metrics.update(logged)
        if hp.log_completions:
            self._record_completions(batch[PROMPTS], texts, all_rewards, advantages)
        return advantages[self.global_rank * rows : (self.global_rank + 1) * rows], metrics

    # ---------------------------------------------------------------------------------------------- training
    @override
    def _add_step_terms(
        self, contribution: Tensor, metrics: dict[str, Tensor], share: int, step_ends: bool
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The entropy bonus, when on."""
        if not self._entropy.enabled:
            return contribution, metrics
        return self._add_entropy_bonus(contribution, metrics, share, step_ends)

    @override
    def _end_normalised_step(self) -> None:
        """Correct the step's provisional token normaliser (module docstring)."""
        if (factor := self._normaliser.correction()) is not None:
            self.rescale_step_gradients(factor)

    def _add_entropy_bonus(
        self, contribution: Tensor, metrics: dict[str, Tensor], share: int, step_ends: bool
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Add ``-c * H / share`` (:mod:`lit_trainer.modules.grpo._entropy`); at the step's end move the adaptive
        coefficient. Logs ``policy_loss`` (the loss without the bonus) and ``entropy_coef`` (mean over the window's
        optimizer steps of the coefficient after each step, as the reference)."""
        world = self.trainer.world_size
        metrics = {**metrics, "policy_loss": contribution.detach() * share}  # averaged over micro-steps and ranks
        contribution = contribution + self._entropy.take_bonus(share)
        if step_ends:
            reduce = (lambda t: self.trainer.strategy.reduce(t, reduce_op="sum")) if world > 1 else (lambda t: t)
            self._entropy.end_step(reduce)
            micro_steps = share // world
            metrics["entropy_coef"] = torch.tensor(self._entropy.coef * micro_steps, device=self.device)
        return contribution, metrics

    @override
    def _num_items(self, slice_index: int, remaining: int, new_window: bool, done: int = 0) -> Tensor | None:
        """The dapo/cispo normaliser of this micro-step (module docstring); None for per-micro-batch-mean types.

        ``remaining``: micro-steps of the optimizer step from this one on (all of them on its first micro-step);
        ``done``: the step's micro-steps before this one, more than 0 on a new window only when resuming inside a step.
        """
        if self.hparams.loss_type not in _TOKEN_NORMALISED:
            return None
        tokens = self._buffer.slice_tokens
        if new_window or self._normaliser is None:
            position = self._buffer.served - 1  # this micro-step's position in the round
            if done and position >= done:  # resumed inside the step: its earlier micro-steps are in this round
                position, remaining = position - done, remaining + done
                self._normaliser = StepNormaliser.start(tokens, position, remaining, self._buffer.round_length)
                for k in range(done):
                    self._normaliser.add(tokens[(position + k) % tokens.numel()])
            else:
                self._normaliser = StepNormaliser.start(tokens, position, remaining, self._buffer.round_length)
        self._normaliser.add(tokens[slice_index])
        return self._normaliser.provisional

    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Policy loss of one buffered micro-batch (``grpo_policy_loss``) and its ``grpo_loss_metrics`` + entropy.

        With the entropy bonus on, the micro-batch's mean entropy (with grad) over the trained tokens is handed to the
        entropy control; :meth:`training_step` adds the bonus with the step's accumulation share.
        """
        hp = self.hparams
        bonus = self._entropy.enabled and self.training
        logps, entropy = self.completion_logps(self.model, batch, with_entropy=True, entropy_grad=bonus)
        mask = batch["completion_mask"]
        options = {k: hp[k] for k in GRPO_LOSS_DEFAULTS.keys() & hp.keys()}  # the loss options GRPOModule takes
        old, advantages, ref = batch.get("old_logps"), batch["advantages"], batch.get("ref_logps")
        sampler = batch.get(SAMPLING_LOGPS)  # a corrected round of asynchronous rollouts only
        entropy_mask, policy_mask = self._policy_masks(logps, entropy.detach(), old, sampler, advantages, mask)
        # the importance-sampling correction: stale rounds of asynchronous rollouts only
        ratio, sampling = self.async_rollouts.importance_ratio(batch, logps, old)
        loss = grpo_policy_loss(
            logps,
            old,
            advantages,
            mask,
            ref_logps=ref,
            num_items_in_batch=num_items_in_batch,
            policy_mask=policy_mask,
            importance_sampling_ratio=ratio,
            **options,
        )
        metrics = grpo_loss_metrics(
            logps, old, advantages, mask, ref_logps=ref, importance_sampling_ratio=ratio, **options
        )
        metrics.update(sampling)
        metrics["entropy"] = masked_mean_entropy(entropy.detach(), mask)
        if bonus:  # the bonus acts on the tokens the policy term trains on (all, or the high-entropy ones)
            self._entropy.observe(entropy, mask if entropy_mask is None else mask * entropy_mask)
        return loss, metrics

    def _policy_masks(
        self,
        logps: Tensor,
        entropy: Tensor,
        old: Tensor | None,
        sampler: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(entropy mask, product of the policy masks)``: ``top_entropy_quantile`` (threshold from the masked
        entropies of every rank's micro-batch) and ``off_policy_mask_threshold``, measured from the sampler's
        log-probs when the round carries them (a corrected round: drift from the weights that sampled it), else from
        ``old`` (``logps.detach()`` when the round stored none), as TRL 1.16; None when off."""
        hp = self.hparams
        entropy_mask = sequence_mask = None
        if hp.top_entropy_quantile < 1.0:
            pool = gather_entropy_pool(entropy, mask, self.trainer.world_size, self.all_gather)
            entropy_mask = high_entropy_mask(entropy, mask, pool, 1.0 - hp.top_entropy_quantile).to(mask.dtype)
        if hp.off_policy_mask_threshold is not None:
            reference = sampler if sampler is not None else (logps.detach() if old is None else old)
            sequence_mask = off_policy_mask(advantages, logps, reference, mask, hp.off_policy_mask_threshold)
        masks = [m for m in (entropy_mask, sequence_mask) if m is not None]
        policy_mask = masks[0] * masks[1] if len(masks) == 2 else (masks[0] if masks else None)
        return entropy_mask, policy_mask
