"""GRPOModule: online RL with group-relative advantages, generating once per ``steps_per_generation`` micro-steps.

Data flow (as TRL's GRPOTrainer, docs/design.md#trl-grpo). The :class:`~lit_trainer.data.prompt.PromptDataModule`
loader yields, on every micro-step, the prompts of this rank's local generation batch (each prompt
``num_generations`` times), the same batch ``steps_per_generation * num_iterations`` times in a row. On the first
micro-step of a round the module samples all completions in ONE batched ``generate`` call, scores them (rewards
gathered over ranks, advantages per group), computes old/reference log-probs only when needed, shuffles the rows with
a seeded generator and cuts them into ``steps_per_generation`` micro-batches; the other micro-steps of the round are
served from that buffer.

Normalisation (overrides the base's ``num_items_in_batch`` handling, which counts items before the batch exists).
``dapo``/``cispo``/``vespo`` divide the masked token-loss sum by the completion tokens of the optimizer step over all
ranks, after truncation masking, so the step gradient equals the full-batch token-mean gradient on its rollouts for any
``steps_per_generation`` and ``accumulate_grad_batches``: when the step's micro-batches are all in the buffer the
count is exact from the start; when the step reaches into the next generation round, a provisional count is
corrected at the step's last micro-batch (:mod:`lit_trainer.modules.grpo._normaliser`; the reference keeps its
approximate ``N * GA_cur / steps_per_generation``). The other loss types are per-micro-batch means as in the
reference, averaged over the step's micro-batches and the ranks.

Randomness and resume. Sampling runs on the global RNG forked and seeded with a hash of ``(generation_seed, round,
rank)``, and the buffer shuffle uses its own generator, so the training RNG stream is untouched and a resumed run
regenerates identical rounds. Checkpoints store the round counters and every rank's buffered rollouts (tensors only,
gathered to the checkpoint under DDP), so resuming in the middle of a round is exact, on one process or several. Only
a resume with another world size regenerates the interrupted round (with that round's seed, for the same prompts).

This file holds the options, the lifecycle and checkpoint hooks, the training step with its normaliser, the policy
loss and validation. Its private parts are beside it in this package: one generation round (generate, score, buffer)
is :class:`~lit_trainer.modules.grpo._rollouts.GRPORolloutMixin`; sampling and decoding the completions
(``_completions``), calling the reward functions (``_reward_calls``), the rollout buffer (``_rollout_buffer``), the
step normaliser (``_normaliser``) and the option checks (``_options``) each have a file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import GenerationConfig
from typing_extensions import Self, override

from lit_trainer._dist import gather_from_all_ranks
from lit_trainer.data.loader import NUM_ITEMS_KEY
from lit_trainer.data.prompt import PROMPT_IDS, PROMPT_MASK, PROMPTS, RolloutGeometry
from lit_trainer.data.samplers.repeat_sampler import resolve_generation_geometry
from lit_trainer.losses.grpo import grpo_loss_metrics, grpo_policy_loss
from lit_trainer.losses.grpo_advantages import Aggregation, ScaleRewards
from lit_trainer.losses.grpo_options import GRPO_LOSS_DEFAULTS, ImportanceSamplingLevel, LossType
from lit_trainer.losses.logprobs import selective_log_softmax
from lit_trainer.modules.base import BaseModule, _sharding
from lit_trainer.modules.grpo import _completions as rollout
from lit_trainer.modules.grpo._normaliser import StepNormaliser
from lit_trainer.modules.grpo._options import OPTION_NAMES, check_grpo_options
from lit_trainer.modules.grpo._reward_calls import as_list, resolve_reward_funcs, score_completions, spec_name
from lit_trainer.modules.grpo._rollout_buffer import RolloutBuffer
from lit_trainer.modules.grpo._rollouts import GRPORolloutMixin, _conversational
from lit_trainer.rewards import reward_function_name

_STATE_KEY = "grpo_rollouts"
_TOKEN_NORMALISED = ("dapo", "cispo", "vespo")


class GRPOModule(GRPORolloutMixin, BaseModule):
    """Group Relative Policy Optimization (TRL 1.16 ``GRPOTrainer`` semantics) as a LightningModule.

    Use it with a :class:`~lit_trainer.data.prompt.PromptDataModule`, whose ``batch_size`` is the reference's
    ``per_device_train_batch_size`` (completions per micro-batch per rank).

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel``.
        reward_funcs: callables ``f(prompts, completions, completion_ids, **columns) -> list[float | None]`` or their
            import paths (``"lit_trainer.rewards.arithmetic_reward"``), and reward models: a sequence-classification
            ``PreTrainedModel``, or a directory / preset / hub id ``org/name`` loaded with one label (a string is a
            model when it is an existing directory, a preset name or contains '/'; otherwise an import path). Each
            model scores ``prompt + completion`` (see :class:`~lit_trainer.rewards.RewardModelScorer`); only these run.
        reward_weights: one weight per function (default all 1.0).
        reward_processing_classes: one entry per ``reward_funcs`` entry: for a reward model its tokenizer (object or
            path; None = the model's own), None for functions (TRL 1.16's argument).
        reward_model_batch_size: rows per reward-model forward pass (None = a rank's whole generation batch in one
            pass, as TRL).
        num_generations: completions per prompt ``G`` (>= 2).
        steps_per_generation: micro-steps served by one generation (default: ``accumulate_grad_batches``).
        generation_batch_size: completions per generation over all ranks (exclusive with the above).
        num_iterations: passes over each generation batch (``mu``; > 1 stores old log-probs).
        max_completion_length: new-token budget per completion (also the Dr. GRPO constant).
        temperature: sampling temperature; log-probs and entropy use logits divided by it, as the reference.
        top_p: nucleus sampling (1.0 = off).
        top_k: top-k sampling (0 = off).
        min_p: min-p sampling (None = off).
        repetition_penalty: 1.0 = off.
        generation_kwargs: extra ``GenerationConfig`` fields (win over the options above).
        mask_truncated_completions: drop completions without EOS from the loss (their rewards still count).
        loss_type: grpo, bnpo, dr_grpo, dapo (default), cispo, sapo, luspo, vespo.
        epsilon: lower clip; also the upper one when ``epsilon_high`` is None.
        epsilon_high: upper clip (and the CISPO cap).
        delta: two-sided cap of the unclipped ratio (> 1), None = off.
        beta: KL coefficient; != 0 keeps a frozen in-memory copy of the initial policy as reference model (with
            ``peft_config`` no copy: the policy with its adapters disabled, or the adapter ``adapter_path`` started
            from; see :class:`~lit_trainer.modules.base._peft.AdapterReference`).
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
        generation_seed: seed of sampling and of the buffer shuffle (hashed with the round and the rank); None = the
            torch initial seed when fitting starts (the CLI's ``seed_everything``).
        **kwargs: optimizer, scheduler and clipping options of :class:`~lit_trainer.modules.base.BaseModule`.

    Raises:
        ValueError: on any invalid option (see :func:`check_grpo_options`), a bad reward function or weight count; at
            setup, on a batch geometry the reference rejects (the message gives a valid one).

    Example::

        module = GRPOModule("tiny", reward_funcs=[arithmetic_reward], num_generations=8, temperature=0.7,
                            max_completion_length=8, learning_rate=1e-4)
        trainer = lightning.Trainer(max_steps=200, accumulate_grad_batches=1)
        trainer.fit(module, datamodule=PromptDataModule(batch_size=64, max_length=16))
    """

    uses_reference_adapter = True

    def __init__(
        self,
        model: Any = "tiny",
        *,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any],
        reward_weights: Sequence[float] | None = None,
        reward_processing_classes: Sequence[Any] | Any = None,
        reward_model_batch_size: int | None = None,
        num_generations: int = 8,
        steps_per_generation: int | None = None,
        generation_batch_size: int | None = None,
        num_iterations: int = 1,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        mask_truncated_completions: bool = False,
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
        generation_seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        options = {k: v for k, v in locals().items() if k in OPTION_NAMES}
        check_grpo_options(options)
        super().__init__(model, **kwargs)
        self.reward_funcs = resolve_reward_funcs(
            reward_funcs,
            reward_processing_classes,
            batch_size=reward_model_batch_size,
            trust_remote_code=kwargs.get("trust_remote_code", False),
        )
        self.reward_names = [reward_function_name(f) for f in self.reward_funcs]
        self.reward_extra: dict[str, list[Any]] = {}  # the last scoring's `log_extra` columns (this rank's rows)
        if reward_weights is not None and len(reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"`reward_weights` has {len(reward_weights)} entries for {len(self.reward_funcs)} reward "
                "functions: give one weight per function (or none for all 1.0)."
            )
        ignore = ["model", "tokenizer", "optimizer", "lr_scheduler", "reward_funcs", "reward_processing_classes"]
        self.save_hyperparameters(ignore=ignore)
        self.hparams["reward_funcs"] = [spec_name(f) for f in as_list(reward_funcs)]  # names only: checkpoint-safe
        if reward_processing_classes is not None:
            self.hparams["reward_processing_classes"] = [
                None if t is None else t if isinstance(t, str) else getattr(t, "name_or_path", type(t).__name__)
                for t in as_list(reward_processing_classes)
            ]
        self.ref_model = self.default_reference() if beta != 0 else None  # under peft: adapters disabled, no copy
        self.rollout_geometry: RolloutGeometry | None = None
        self._buffer: RolloutBuffer | None = None
        self._restored: dict[str, Any] | None = None
        self._normaliser: StepNormaliser | None = None
        self._seed = generation_seed
        self.val_metrics.add("reward", MeanMetric(nan_strategy="ignore"))
        self._val_reward_means = [
            self.val_metrics.add(f"rewards/{name}/mean", MeanMetric(nan_strategy="ignore"))
            for name in self.reward_names
        ]  # one per function, even when two share a name

    # ------------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        batch_size = getattr(getattr(datamodule, "hparams", None), "batch_size", None)
        if batch_size is None:
            raise ValueError(
                "GRPOModule needs a PromptDataModule passed as `trainer.fit(module, datamodule=...)`: its "
                "`batch_size` is the per-device train batch size."
            )
        hp = self.hparams
        spg, gbs = resolve_generation_geometry(
            batch_size,
            hp.num_generations,
            self.trainer.world_size,
            self.trainer.accumulate_grad_batches,
            hp.steps_per_generation,
            hp.generation_batch_size,
        )
        self.rollout_geometry = RolloutGeometry(hp.num_generations, spg, gbs, hp.num_iterations)
        self._buffer = RolloutBuffer(spg, hp.num_iterations)
        strategy = type(self.trainer.strategy).__name__
        if (
            hp.loss_type in _TOKEN_NORMALISED
            and spg % self.trainer.accumulate_grad_batches
            and not _sharding.has_local_grads(self.trainer.strategy)
        ):
            raise ValueError(
                f"GRPOModule(loss_type={hp.loss_type!r}) with steps_per_generation={spg} not a multiple of "
                f"accumulate_grad_batches={self.trainer.accumulate_grad_batches} corrects the step's "
                f"gradient in `param.grad`, which {strategy} does not use: use strategy 'ddp', or make "
                "steps_per_generation a multiple of accumulate_grad_batches."
            )

    @override
    def on_fit_start(self) -> None:
        if self._restored is not None and self._buffer is not None:
            state, self._restored = self._restored, None
            self._seed = int(state["seed"])
            ranks = state.get("ranks", [state])  # older checkpoints: one state, with rollouts on a single process
            if len(ranks) == self.trainer.world_size == int(state["world_size"]):
                self._buffer.load_state_dict(ranks[self.global_rank], self.device)
            else:  # another world size: counters only, the interrupted round is regenerated
                self._buffer.load_state_dict({k: ranks[0][k] for k in ("served", "rounds")}, self.device)
        if self._seed is None:
            self._seed = torch.initial_seed()

    @override
    def train(self, mode: bool = True) -> Self:
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()  # the frozen reference never runs dropout
        return self

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._buffer is not None:
            ranks = gather_from_all_ranks(self._buffer.state_dict(with_rollouts=True))  # a collective under DDP
            checkpoint[_STATE_KEY] = {"seed": self._seed, "world_size": len(ranks), "ranks": ranks}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._restored = checkpoint.get(_STATE_KEY)

    # ---------------------------------------------------------------------------------------------- training
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        batch.pop(NUM_ITEMS_KEY, None)
        if batch_idx == 0:
            self._buffer.end_round()  # an epoch always starts a round (even if the last one was cut short)
        new_window = self._enter_window(batch_idx)
        if self._buffer.needs_refill:
            self._make_rollouts(batch)
        micro, slice_index = self._buffer.next()
        start, stop = self.step_window(batch_idx)
        num_items = self._num_items(slice_index, stop - batch_idx, new_window)
        loss, metrics = self.compute_loss(micro, num_items)
        world = self.trainer.world_size
        contribution = loss if num_items is not None else loss / ((stop - start) * world)
        masks = {"prompt_attention_mask": micro["prompt_mask"], "completion_attention_mask": micro["completion_mask"]}
        self._track(contribution.detach(), {**metrics, **self._buffer.metrics}, masks)
        step_ends = batch_idx + 1 == stop or self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if num_items is not None and step_ends and (factor := self._normaliser.correction()) is not None:
            self.rescale_step_gradients(factor)
        return contribution * self.trainer.accumulate_grad_batches * world

    def _num_items(self, slice_index: int, remaining: int, new_window: bool) -> Tensor | None:
        """The dapo/cispo normaliser of this micro-step (module docstring); None for per-micro-batch-mean types.

        ``remaining``: micro-steps of the optimizer step from this one on (all of them on its first micro-step).
        """
        if self.hparams.loss_type not in _TOKEN_NORMALISED:
            return None
        tokens = self._buffer.slice_tokens
        if new_window or self._normaliser is None:
            position = self._buffer.served - 1  # this micro-step's position in the round
            self._normaliser = StepNormaliser.start(tokens, position, remaining, self._buffer.round_length)
        self._normaliser.add(tokens[slice_index])
        return self._normaliser.provisional

    @override
    def compute_loss(
        self, batch: dict[str, Any], num_items_in_batch: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Policy loss of one buffered micro-batch (``grpo_policy_loss``) and its ``grpo_loss_metrics`` + entropy."""
        hp = self.hparams
        logps, entropy = self.completion_logps(self.model, batch, with_entropy=True)
        mask = batch["completion_mask"]
        options = {k: hp[k] for k in GRPO_LOSS_DEFAULTS.keys() & hp.keys()}  # the loss options GRPOModule takes
        old, advantages, ref = batch.get("old_logps"), batch["advantages"], batch.get("ref_logps")
        loss = grpo_policy_loss(
            logps, old, advantages, mask, ref_logps=ref, num_items_in_batch=num_items_in_batch, **options
        )
        metrics = grpo_loss_metrics(logps, old, advantages, mask, ref_logps=ref, **options)
        metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        return loss, metrics

    def completion_logps(
        self, model: Any, rows: dict[str, Tensor], with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (B, C) of the completion tokens under ``model``, logits divided by the temperature.

        The input is ``[left-padded prompt ; right-padded completion]`` with position ids from the attention mask
        (as ``generate`` uses), so the log-probs match the sampling distribution. Entropy (no grad) when asked.
        """
        completion = rows["completion_ids"]
        ids = torch.cat([rows["prompt_ids"], completion], dim=1)
        attention = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=completion.shape[1] + 1,
        ).logits[:, :-1]
        temperature = self.hparams.temperature
        logps = selective_log_softmax(logits, completion, temperature)
        if not with_entropy:
            return logps, None
        with torch.no_grad():
            z = logits.float() / temperature
            entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        return logps, entropy

    # -------------------------------------------------------------------------------------------- validation
    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Greedy completion of each held-out prompt, scored by the reward functions (``val_reward``)."""
        eos = rollout.eos_token_ids(self.model, self.tokenizer)
        config = GenerationConfig(
            max_new_tokens=self.hparams.max_completion_length,
            do_sample=False,
            pad_token_id=self._pad_token_id(eos),
            eos_token_id=eos,
            use_cache=True,
        )
        completions = rollout.generate_completions(
            self.model, batch[PROMPT_IDS], batch[PROMPT_MASK], config, eos, _sharding.is_sharded(self.model)
        )
        texts, kept = rollout.decode_completions(self.tokenizer, completions, _conversational(batch[PROMPTS]))
        rewards, logged = score_completions(self, batch, texts, kept)
        for name, value in logged.items():
            self.log(f"val_{name}", value, on_epoch=True, sync_dist=True, batch_size=len(texts))
        rewards = rewards.to(self.device)
        weights = torch.as_tensor(self.hparams.reward_weights or [1.0] * rewards.shape[1], device=self.device)
        total = torch.nansum(rewards * weights, dim=1).masked_fill(torch.isnan(rewards).all(dim=1), float("nan"))
        self.val_metrics["reward"].update(total)
        for metric, column in zip(self._val_reward_means, rewards.T):
            metric.update(column)
