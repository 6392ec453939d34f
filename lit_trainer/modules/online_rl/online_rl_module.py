"""OnlineRLModule: the base of the online-RL modules (:class:`~lit_trainer.modules.grpo.GRPOModule`,
:class:`~lit_trainer.modules.rloo.RLOOModule`), which sample their own training rows from the policy.

It holds what they share: the rollout generator (``self.rollouts``, :mod:`lit_trainer.generation`), the reward
functions and reward models with their weights, tools, environments and ``rollout_func``, the rollout geometry
(``steps_per_generation`` / ``generation_batch_size`` / ``num_iterations``), the round buffer and its exact resume, the
reference model for ``beta`` (:class:`~lit_trainer.modules.reference.ReferenceModel`, with TR-DPO's sync),
validation (greedy or sampled), completion logging and the progress bar's reward. A subclass brings its round
(:meth:`_make_rollouts`: advantages and the log-probs it needs, in its order) and its loss (:meth:`compute_loss`);
:meth:`_num_items` and the two training-step hooks are where GRPO's token normaliser and entropy bonus plug in.

Data flow (as TRL's GRPOTrainer and RLOOTrainer, docs/design.md#trl-grpo). The
:class:`~lit_trainer.data.prompt.PromptDataModule` loader yields, on every micro-step, the prompts of this rank's local
generation batch (each prompt ``num_generations`` times), the same batch ``steps_per_generation * num_iterations``
times in a row. On the first micro-step of a round the module samples all completions in ONE batched ``generate``
call, scores them (rewards gathered over ranks, advantages per group), computes old/reference log-probs only when
needed, shuffles the rows with a seeded generator and cuts them into ``steps_per_generation`` micro-batches; the other
micro-steps of the round are served from that buffer.

Randomness and resume. Sampling runs on the global RNG forked and seeded with a hash of ``(generation_seed, round,
rank)``, and the buffer shuffle uses its own generator, so the training RNG stream is untouched and a resumed run
regenerates identical rounds. Checkpoints store the round counters and every rank's buffered rollouts (tensors only,
gathered to the checkpoint under DDP, under the key ``grpo_rollouts`` for both modules), so resuming in the middle of
a round is exact, on one process or several. Only a resume with another world size regenerates the interrupted round
(with that round's seed, for the same prompts). A checkpoint written inside an optimizer step (a validation between
its micro-batches, with ``ExactResume``) resumes exactly too.

Tools, environments and ``rollout_func`` (:mod:`lit_trainer.generation.agentic`). With ``tools`` or an
``environment_factory`` the round's single ``generate`` becomes a batched multi-turn loop
(:mod:`lit_trainer.generation.agentic.multi_turn`): every rollout's first turn in one call, the rows that call
tools run them (:mod:`lit_trainer.generation.agentic.tools`, environments in
:mod:`lit_trainer.generation.agentic.environments`) and continue together in one call per turn. Tool-result
tokens are in the rows (``completion_attention_mask``) but not in ``completion_mask``, which is the loss mask and
what a token normaliser counts. A ``rollout_func`` replaces generation.
The scored rows go through the same buffer, so resume stays exact without any environment state.

Images (a vision-language policy, e.g. ``tiny-vl``, on prompts with an ``images``/``image`` column, processed by the
:class:`~lit_trainer.data.prompt.PromptDataModule` with the model's processor). Each prompt row carries its image inputs
(:mod:`lit_trainer.data.vision.prompt`: per-image tensors kept per row, so the ``num_generations`` copies of a prompt
and the buffer's shuffle keep every row with its own pictures); ``generate``, the policy, old and reference log-probs
(plain or chunked head) and validation all get the rows' image inputs with their ids, and the image token is never
sampled (as TRL 1.16). The reward functions get the decoded images under the column's name (``images``: a list of PIL
images per completion) and the conversational prompts with the images filled in, as TRL's. Tools and environments,
``rollout_func``, continuous batching and ``chat_template_kwargs`` do not carry images yet: refused at setup
(:meth:`OnlineRLModule._check_images`).

The shared steps of a round (sample with ``self.rollouts``, gather the scores over ranks, log-probs in chunks, shuffle
and buffer) are methods of this class; its private parts are beside it in :mod:`lit_trainer.modules.online_rl`:
calling the reward functions (``_reward_calls``), the rollout buffer (``_rollout_buffer``), the completion log-prob
forward of the trainer and the rollout worker (``_logps``), the completions table (``_completion_table``) and the
option checks (``_options``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import GenerationConfig
from typing_extensions import Self, override

from lit_trainer.core import sharding as _sharding
from lit_trainer.core.dist import gather_from_all_ranks
from lit_trainer.core.stop_request import stop_check, stop_in_step
from lit_trainer.data.loader import NUM_ITEMS_KEY
from lit_trainer.data.prompt import PROMPTS, RolloutGeometry
from lit_trainer.data.samplers.repeat_sampler import needs_old_logps, resolve_generation_geometry
from lit_trainer.data.vision import prompt as vision_prompt
from lit_trainer.generation import RolloutEngine, RolloutGenerator, Round, SamplingOptions, make_engine
from lit_trainer.generation import engines as rollout
from lit_trainer.generation.agentic import AgenticRound, agentic_batch, resolve_rollout_func
from lit_trainer.generation.agentic.environments import Environments, describe_factories
from lit_trainer.generation.agentic.tools import resolve_tools, tool_name
from lit_trainer.models import is_vision_model
from lit_trainer.modules.base import BaseModule
from lit_trainer.modules.base._ref_sync import ReferenceSyncMixin
from lit_trainer.modules.online_rl._completion_table import render_text, write_completion_table
from lit_trainer.modules.online_rl._logps import chunked_logps, completion_logps
from lit_trainer.modules.online_rl._options import CacheImplementation, check_options
from lit_trainer.modules.online_rl._reward_calls import as_list, resolve_reward_funcs, score_completions, spec_name
from lit_trainer.modules.online_rl._rollout_buffer import RolloutBuffer
from lit_trainer.modules.reference import ReferenceModel
from lit_trainer.rewards import RewardModelInputs, is_conversational, reward_function_name

_STATE_KEY = "grpo_rollouts"  # the buffer's checkpoint key (GRPOModule's name from before RLOO shared it)

__all__ = ["OnlineRLModule"]


class OnlineRLModule(ReferenceSyncMixin, BaseModule):
    """The base of the online-RL modules: rollouts, rewards, the round buffer, the reference model, validation.

    Not trained on its own: a subclass defines its round (:meth:`_make_rollouts`, advantages and the log-probs its loss
    needs, then :meth:`_buffer_round`) and its loss (:meth:`compute_loss`), and adds its own options. Use a subclass
    with a :class:`~lit_trainer.data.prompt.PromptDataModule`, whose ``batch_size`` is the reference's
    ``per_device_train_batch_size`` (completions per micro-batch per rank).

    Args:
        model: preset name, local directory, hub id, or a ``PreTrainedModel``.
        reward_funcs: callables ``f(prompts, completions, completion_ids, **columns) -> list[float | None]`` or their
            import paths (``"lit_trainer.rewards.arithmetic_reward"``), and reward models: a sequence-classification
            ``PreTrainedModel``, or a directory / preset / hub id ``org/name`` loaded with one label (a string is a
            model when it is an existing directory, a preset name or contains '/'; otherwise an import path). Each
            model scores ``prompt + completion`` (see :class:`~lit_trainer.rewards.RewardModelScorer`); only these run.
        reward_weights: one weight per function (default all 1.0); an environment's ``get_reward`` gets 1.0.
        reward_processing_classes: one entry per ``reward_funcs`` entry: for a reward model its tokenizer (object or
            path; None = the model's own), None for functions (TRL 1.16's argument).
        reward_model_batch_size: rows per reward-model forward pass (None = a rank's whole generation batch in one
            pass, as TRL).
        reward_model_inputs: what a reward model reads for standard (string) prompts: ``"as_trained"`` (default)
            ``prompt + completion + EOS`` with the reward tokenizer's special tokens, the rows reward models are
            trained on (:class:`~lit_trainer.modules.reward.RewardModule`, TRL's ``RewardTrainer``); ``"trl"``
            TRL 1.16's ``GRPOTrainer`` text, ``prompt + completion`` without EOS or special tokens (a deliberate
            difference from TRL: a reward model trained on EOS-ended rows ranks answers near chance on that text,
            docs/reward.md). Conversational prompts go through the chat template either way.
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
        eval_do_sample: validation samples each held-out prompt's completion with the training settings
            (``temperature``, ``top_p``, ...; seeded by ``generation_seed`` and the batch, so two validations of the
            same weights agree) instead of the default greedy completion: what the policy does when it explores, e.g.
            how often it calls a tool, rather than its single most likely answer.
        beta: KL coefficient (the subclass says where the KL enters: GRPO's loss term, RLOO's reward penalty); != 0
            keeps a frozen in-memory copy of the initial policy as reference model (with ``peft_config`` no copy: the
            policy with its adapters disabled, or the adapter ``adapter_path`` started from; see
            :class:`~lit_trainer.modules.base._peft.AdapterReference`).
        sync_ref_model: TR-DPO for the KL reference: after every ``ref_model_sync_steps``-th optimizer step
            ``θ_ref ← (1−α)θ_ref + αθ_policy`` (needs ``beta != 0`` and no ``peft_config``/``adapter_path``; shared
            with :class:`~lit_trainer.modules.dpo.DPOModule`).
        ref_model_mixup_alpha: ``α`` of TR-DPO, in [0, 1].
        ref_model_sync_steps: TR-DPO period in optimizer steps.
        log_completions: at every logging step, write the last round's prompts, completions, rewards per function and
            advantages (all ranks' rows) to the console (rank 0, rich), ``completions.csv`` in a CSVLogger's folder,
            TensorBoard (``add_text``) and any logger with ``log_table`` (WandbLogger, Trackio).
        num_completions_to_print: rows printed on the console (a sample seeded by the step); None = all.
        log_unique_prompts: the loggers get one row per distinct prompt (its first completion) instead of all rows.
        cache_implementation: ``GenerationConfig.cache_implementation`` of the sampling ``generate`` (e.g.
            ``"static"``); None = the model's default (dynamic).
        use_transformers_continuous_batching: generate with transformers' continuous-batching engine
            (``generate_batch``, paged KV cache) instead of ``generate``; not under sharding.
        transformers_continuous_batching_config: ``transformers.ContinuousBatchingConfig`` fields
            (``max_memory_percent`` defaults to 0.5, as the reference).
        use_transformers_paged: deprecated alias of ``use_transformers_continuous_batching`` (as in TRL 1.16).
        tools: functions the model may call (callables or import paths; type hints and a Google docstring give their
            schema). Their schemas go to the chat template (``tools=``), calls in a completion
            (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` for the presets) are run and their results
            appended as ``tool`` messages, and generation continues, all rows of a round together; tool-result tokens
            get no loss (see :mod:`lit_trainer.generation.agentic.multi_turn`). Needs conversational prompts.
        environment_factory: TRL 1.16's environments: a factory (class, function or import path) making one
            environment per rollout, or a dict of them chosen by an ``environment`` column; ``reset(**row)`` starts
            a rollout, public methods are tools, ``get_reward()`` is an extra reward function named after the class
            (see :mod:`lit_trainer.generation.agentic.environments`).
        max_tool_calling_iterations: tool rounds per rollout at most (None = until no call or no room).
        rollout_func: replaces generation: ``rollout_func(prompts, module) -> {"prompt_ids", "completion_ids",
            "logprobs", ...}`` (lists, one per row; a callable or import path). An ``env_mask`` (1 = model token)
            masks the loss; other keys reach the reward functions as keywords (see
            :mod:`lit_trainer.generation.agentic`).
        chat_template_kwargs: extra ``apply_chat_template`` keywords (template variables) for conversational
            prompts, tool messages and the reward models' texts, as TRL 1.16's ``GRPOConfig.chat_template_kwargs``.
        generation_seed: seed of sampling and of the buffer shuffle (hashed with the round and the rank); None = the
            torch initial seed when fitting starts (the CLI's ``seed_everything``).
        learning_rate: peak learning rate (TRL's ``GRPOConfig`` default 1e-6).
        **kwargs: optimizer, scheduler and clipping options of :class:`~lit_trainer.modules.base.BaseModule`.


    Raises:
        ValueError: on any invalid option (each message names the class the user constructed and a valid value), a
            bad reward function or weight count, ``sync_ref_model`` with ``beta=0`` or a peft-wrapped policy; at setup,
            on a batch geometry the reference rejects (the message gives a valid one), or continuous batching under
            sharding.
    """

    uses_reference_adapter = True
    #: the bar shows the window's mean reward: the policy loss of a round is near 0 by construction (advantages are
    #: centred per group), so the reward is what says whether the policy improves
    PROGRESS_BAR_METRICS: ClassVar[dict[str, str]] = {"reward": "reward"}

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
        beta: float = 0.0,
        sync_ref_model: bool = False,
        ref_model_mixup_alpha: float = 0.6,
        ref_model_sync_steps: int = 512,
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
        generation_seed: int | None = None,
        learning_rate: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__  # the class the user constructed (GRPOModule, RLOOModule): named in every message
        check_options({k: v for k, v in locals().items() if k not in ("self", "name", "kwargs")}, name)
        if use_transformers_paged:
            warnings.warn(
                f"`{name}(use_transformers_paged=True)` is deprecated (as in TRL 1.16): use "
                "`use_transformers_continuous_batching=True`.",
                FutureWarning,
                stacklevel=3,  # the user's call of the subclass
            )
        super().__init__(model, learning_rate=learning_rate, **kwargs)
        self.reference = ReferenceModel(
            self, sync=sync_ref_model, mixup_alpha=ref_model_mixup_alpha, sync_steps=ref_model_sync_steps
        )
        self.continuous_batching = use_transformers_continuous_batching or use_transformers_paged
        self.engine: RolloutEngine = make_engine(
            self.continuous_batching,
            transformers_continuous_batching_config,
            self._rollout_engine_path(),
            self._rollout_engine_options(),
        )
        # the round's sampling: options and engine, no attribute of this module (the async worker builds its own)
        self.rollouts = RolloutGenerator(self.engine, SamplingOptions.from_hparams(self.hparams), self.tokenizer)
        self.completion_table: tuple[list[str], list[list[Any]]] | None = None  # the last round's (log_completions)
        self.tools = resolve_tools(tools)
        self.environments = Environments(environment_factory, self.tools) if environment_factory is not None else None
        self.agentic = bool(self.tools) or self.environments is not None
        self.rollout_func = resolve_rollout_func(rollout_func)
        own_rewards = self.environments.reward_funcs if self.environments is not None else []
        given = [] if own_rewards and not as_list(reward_funcs) else reward_funcs  # an environment may own the reward
        self.reward_funcs = (
            resolve_reward_funcs(
                given,
                reward_processing_classes,
                batch_size=reward_model_batch_size,
                trust_remote_code=kwargs.get("trust_remote_code", False),
                reward_model_inputs=reward_model_inputs,
                chat_template_kwargs=chat_template_kwargs,
            )
            if as_list(given) or not own_rewards
            else []
        )
        if reward_weights is not None and len(reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"`reward_weights` has {len(reward_weights)} entries for {len(self.reward_funcs)} reward "
                "functions: give one weight per function (or none for all 1.0)."
            )
        self.reward_weights = None if reward_weights is None else [*reward_weights, *[1.0] * len(own_rewards)]
        self.reward_funcs += own_rewards
        self.reward_names = [reward_function_name(f) for f in self.reward_funcs]
        self.reward_extra: dict[str, list[Any]] = {}  # the last scoring's `log_extra` columns (this rank's rows)
        ignore = ["model", "tokenizer", "optimizer", "lr_scheduler", "reward_funcs", "reward_processing_classes"]
        ignore += ["tools", "environment_factory", "rollout_func"]
        self.save_hyperparameters(ignore=ignore)  # with the subclass's own arguments (Lightning reads its frame too)
        self.hparams["reward_funcs"] = [spec_name(f) for f in as_list(reward_funcs)]  # names only: checkpoint-safe
        self.hparams["tools"] = [t if isinstance(t, str) else tool_name(t) for t in as_list(tools or [])]
        if environment_factory is not None:
            self.hparams["environment_factory"] = describe_factories(environment_factory)
        if rollout_func is not None:
            self.hparams["rollout_func"] = rollout_func if isinstance(rollout_func, str) else tool_name(rollout_func)
        if reward_processing_classes is not None:
            self.hparams["reward_processing_classes"] = [
                None if t is None else t if isinstance(t, str) else getattr(t, "name_or_path", type(t).__name__)
                for t in as_list(reward_processing_classes)
            ]
        self.ref_model = None  # beta = 0: no KL term, no reference
        if beta != 0:
            self.reference.build(None)  # a frozen copy; under peft the policy with its adapters disabled, no copy
        self.rollout_geometry: RolloutGeometry | None = None
        self._buffer: RolloutBuffer | None = None
        self._restored: dict[str, Any] | None = None
        self._fit_started = False  # on_fit_start ran in this fit (a checkpoint loaded after it is applied at once)
        self._seed = generation_seed
        self.val_metrics.add("reward", MeanMetric(nan_strategy="ignore"))
        self._val_reward_means = [
            self.val_metrics.add(f"rewards/{name}/mean", MeanMetric(nan_strategy="ignore"))
            for name in self.reward_names
        ]  # one per function, even when two share a name

    def _rollout_engine_path(self) -> str | None:
        """Import path of a :class:`~lit_trainer.generation.RolloutEngine` subclass to sample with, or ``"vllm"``: the
        subclass's ``rollout_engine`` option (GRPO's, RLOO's; None: ``generate``, or continuous batching when asked);
        read once, in ``__init__``."""
        return self.hparams.get("rollout_engine")

    def _rollout_engine_options(self) -> dict[str, Any] | None:
        """Keyword arguments of that engine's class: the subclass's ``rollout_engine_options`` option."""
        return self.hparams.get("rollout_engine_options")

    # ------------------------------------------------------------------------------------------------ lifecycle
    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        self._fit_started = False  # a new run of the trainer (a failed fit calls no teardown)
        if stage != "fit":
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        batch_size = getattr(getattr(datamodule, "hparams", None), "batch_size", None)
        if batch_size is None:
            raise ValueError(
                f"{type(self).__name__} needs a PromptDataModule passed as `trainer.fit(module, datamodule=...)`: its "
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
        self._check_geometry(spg)
        if getattr(datamodule, "image_column", None) is not None:
            self._check_images(datamodule.image_column)
        longest = datamodule.longest_row() if callable(getattr(datamodule, "longest_row", None)) else None
        self.engine.check_fit(type(self).__name__, longest, hp.max_completion_length)  # e.g. vLLM's environment

    @override
    def configure_callbacks(self) -> list[Callback]:
        """An engine that holds a server (vLLM) is closed when fitting fails, too (:class:`CloseEngines`)."""
        return [*super().configure_callbacks(), *rollout.close_on_failure(self.engine)]

    def _image_refusals(self) -> dict[str, tuple[bool, str]]:
        """``{option: (used, why it cannot carry images)}`` for :meth:`_check_images`."""
        hp = self.hparams
        return {
            "tools / environment_factory": (self.agentic, "tool and environment turns are rendered as text only"),
            "rollout_func": (self.rollout_func is not None, "a rollout_func receives the prompts without the images"),
            "use_transformers_continuous_batching": (
                self.continuous_batching,
                "transformers' continuous batching takes token ids only (TRL 1.16 refuses it for processors too)",
            ),
            "chat_template_kwargs": (
                bool(hp.get("chat_template_kwargs")),
                "the prompts with images are rendered by the data module, which does not know the module's template "
                "options",
            ),
        }

    def _check_images(self, column: str) -> None:
        """Prompts with images: refuse a text-only policy and what does not carry images yet
        (:meth:`_image_refusals`)."""
        name = type(self).__name__
        if not is_vision_model(self.model):
            raise ValueError(
                f"The prompts have images (column {column!r}) but the {name} policy is a text-only model: train a "
                "vision-language model (model: tiny-vl, or a saved image-text-to-text model), or drop the image column."
            )
        for option, (used, why) in self._image_refusals().items():
            if used:
                raise ValueError(
                    f"{name}: `{option}` is not supported with prompts that have images (column {column!r}): {why}. "
                    f"Unset `{option}`, or train on text prompts."
                )

    @override
    def sequence_budget(self, longest_row: int, positions: int) -> tuple[int, str, str]:
        """The longest prompt plus ``max_completion_length`` (see :meth:`BaseModule.sequence_budget`)."""
        budget = self.hparams.max_completion_length
        what = (
            f"the longest prompt ({longest_row} tokens) + max_completion_length={budget} = {longest_row + budget} "
            "tokens" + (" (the prompt counted without the tools' schemas)" if self.agentic else "")
        )
        room = positions - longest_row
        fix = f"lower max_completion_length to at most {room}, or" if room > 0 else "lower"
        return longest_row + budget, what, f"{fix} the data module's `max_length` (longer prompts are dropped)"

    def _check_geometry(self, spg: int) -> None:
        """Refuse what cannot run with this ``steps_per_generation`` and strategy (the fix in the message)."""
        if self.continuous_batching and _sharding.is_sharded(self.model):
            strategy = type(self.trainer.strategy).__name__
            raise ValueError(
                f"`{type(self).__name__}(use_transformers_continuous_batching=True)` cannot generate with sharded "
                f"weights ({strategy}): every forward is a collective and the engine schedules each rank on its own. "
                "Use strategy 'ddp', or plain `generate` (use_transformers_continuous_batching=False)."
            )

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._fit_started = True
        self._apply_restored()
        if self._seed is None:
            self._seed = torch.initial_seed()
        self.reset_reference_sync()

    def _apply_restored(self) -> None:
        """Restore a loaded checkpoint's generation seed and round buffer once fitting has started AND the checkpoint
        is loaded, whichever comes last: Lightning loads it before ``on_fit_start`` for most strategies, and after it
        for those that restore after their setup (``ModelParallelStrategy``, FSDP2: ``restore_checkpoint_after_setup``),
        where a restore in ``on_fit_start`` alone never happened."""
        if not self._fit_started or self._restored is None or self._buffer is None:
            return
        state, self._restored = self._restored, None
        self._seed = int(state["seed"])
        ranks = state.get("ranks", [state])  # older checkpoints: one state, with rollouts on a single process
        if len(ranks) == self.trainer.world_size == int(state["world_size"]):
            self._buffer.load_state_dict(ranks[self.global_rank], self.device)
        else:  # another world size: counters only, the interrupted round is regenerated
            self._buffer.load_state_dict({k: ranks[0][k] for k in ("served", "rounds")}, self.device)

    @override
    def teardown(self, stage: str) -> None:
        self._fit_started = False
        self.engine.close()  # an engine's server in this process (vLLM), if one started
        super().teardown(stage)

    @override
    def train(self, mode: bool = True) -> Self:
        super().train(mode)
        self.reference.keep_eval()  # the frozen reference never runs dropout
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
        self._apply_restored()  # now when fitting started first (FSDP2), else in on_fit_start

    @override
    def _write_logs(self) -> None:
        """The step's logs, and with ``log_completions`` the last round's completions table (rank 0)."""
        super()._write_logs()
        if self.hparams.log_completions and self.completion_table is not None and self.trainer.is_global_zero:
            columns, rows = self.completion_table
            step = self.trainer.global_step - 1  # the step Lightning gives this step's metrics (metrics.csv, TB)
            write_completion_table(
                self.trainer.loggers,
                columns,
                rows,
                step,
                num_to_print=self.hparams.num_completions_to_print,
                unique_prompts=self.hparams.log_unique_prompts,
            )

    # ---------------------------------------------------------------------------------------------- training
    def _make_rollouts(self, batch: dict[str, Any], can_stop: bool = False, position: tuple[int, int] = (0, 0)) -> None:
        """Generate, score and buffer one round (:meth:`_generate_rows`, then the subclass's advantages and log-probs,
        then :meth:`_buffer_round`).

        ``can_stop``: the round starts an optimizer step (nothing of the step is applied yet), so a stop request (a
        signal, :mod:`lit_trainer.core.stop_request`) may end its generation early; the ranks then agree, right after
        generating, whether to drop the round and save the last finished step (the callback raises) or go on.
        ``position``: ``(epoch, batch index)`` of the round's first micro-step.
        """
        raise NotImplementedError(f"{type(self).__name__} must define _make_rollouts (one generation round)")

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        batch.pop(NUM_ITEMS_KEY, None)
        if batch_idx == 0:
            self._buffer.end_round()  # an epoch always starts a round (even if the last one was cut short)
        new_window = self._enter_window(batch_idx)
        start, stop = self.step_window(batch_idx)
        if self._buffer.needs_refill:  # a round that starts an optimizer step may be stopped by a signal
            self._make_rollouts(batch, can_stop=batch_idx == start, position=(self.trainer.current_epoch, batch_idx))
        micro, slice_index = self._buffer.next()
        num_items = self._num_items(slice_index, stop - batch_idx, new_window, batch_idx - start)
        loss, metrics = self.compute_loss(micro, num_items)
        world = self.trainer.world_size
        share = (stop - start) * world  # micro-steps of this optimizer step x ranks
        contribution = loss if num_items is not None else loss / share
        step_ends = batch_idx + 1 == stop or self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        contribution, metrics = self._add_step_terms(contribution, metrics, share, step_ends)
        masks = {"prompt_attention_mask": micro["prompt_mask"], "completion_attention_mask": micro["completion_mask"]}
        self._track(contribution.detach(), {**metrics, **self._buffer.metrics}, masks)
        if num_items is not None and step_ends:
            self._end_normalised_step()
        return contribution * self.trainer.accumulate_grad_batches * world

    def _num_items(self, slice_index: int, remaining: int, new_window: bool, done: int = 0) -> Tensor | None:
        """The loss normaliser of this micro-step, None for a per-micro-batch mean (the default: the micro-batch's
        loss is divided by the optimizer step's micro-steps x ranks, as the references accumulate it).

        ``remaining``: micro-steps of the optimizer step from this one on (all of them on its first micro-step);
        ``done``: the step's micro-steps before this one, more than 0 on a new window only when resuming inside a step.
        """
        return None

    def _add_step_terms(
        self, contribution: Tensor, metrics: dict[str, Tensor], share: int, step_ends: bool
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Terms added to the micro-step's loss contribution before it is tracked (none by default)."""
        return contribution, metrics

    def _end_normalised_step(self) -> None:
        """At the last micro-step of a step with a normaliser (:meth:`_num_items` not None), after tracking it."""

    def completion_logps(
        self, model: Any, rows: dict[str, Tensor], with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (B, C) of the completion tokens under ``model``, logits divided by the temperature.

        The input is ``[left-padded prompt ; right-padded completion]`` with position ids from the attention mask
        (as ``generate`` uses), so the log-probs match the sampling distribution. Entropy when asked (with gradient
        only when ``entropy_grad``: the entropy bonus). Rows of prompts with images carry their image inputs
        (:mod:`lit_trainer.data.vision.prompt`), passed to the model with the ids. The forward is
        :func:`~lit_trainer.modules.online_rl._logps.completion_logps` with this module's :meth:`score_tokens`; GRPO's
        rollout worker runs its ``behaviour_scorer``'s (override both to change it).
        """
        return completion_logps(
            self.score_tokens,
            model,
            rows,
            temperature=self.hparams.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    # ------------------------------------------------------------------------------- one round's shared steps
    def _gather_rows(self, local: Tensor) -> Tensor:
        """Rows of every rank, rank order (the reference gathers rewards before normalising)."""
        if self.trainer.world_size == 1:
            return local
        return self.all_gather(local).reshape(-1, *local.shape[1:])

    def _sampling_config(self, eos: list[int]) -> Any:
        """The ``GenerationConfig`` of the training rollouts (and of a sampled validation): ``self.rollouts``'s."""
        return self.rollouts.sampling_config(self.model, eos)

    def _image_token_ids(self) -> list[int]:
        """A vision-language policy's image token id, never sampled; empty for a text model."""
        return self.rollouts.image_token_ids(self.model)

    def _prompt_inputs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids and mask for ``generate``, rendered again with ``chat_template_kwargs``
        (:meth:`~lit_trainer.generation.RolloutGenerator.prompt_inputs`)."""
        return self.rollouts.prompt_inputs(batch, self.device)

    def _stores_old_logps(self) -> bool:
        """Whether a round keeps its generation-time log-probs (used across optimizer steps); read per round, since a
        ``GradientAccumulationScheduler`` may change ``accumulate_grad_batches`` at an epoch start."""
        return needs_old_logps(
            self.trainer.accumulate_grad_batches,
            self.rollout_geometry.steps_per_generation,
            self.hparams.num_iterations,
        )

    def _generate_rows(self, batch: dict[str, Any], can_stop: bool) -> tuple:
        """Sample this rank's rows of one round in this process (:meth:`_sample_round`), seeded by round and rank;
        ``can_stop``: a stop request may cut the generation short, and the run then stops here."""
        seed = rollout.rollout_seed(self._seed, self._buffer.next_round_index, self.global_rank)
        should_stop = stop_check(self.trainer) if can_stop else None
        sampled = self._sample_round(batch, seed, should_stop)
        if should_stop is not None:
            stop_in_step(self.trainer)  # raises when the run stops here; the partial round is dropped
        return sampled

    def _engine_logps(self, rows: dict[str, Tensor], completions: rollout.Completions, decoded: Any) -> Tensor | None:
        """The engine's own log-probs of a plain round's completion tokens (vLLM's ``Completions.logps``): the
        behaviour log-probs that round's correction and sampler check use. None for an engine with the trainer's
        numerics, for a round with tools or a ``rollout_func`` (``decoded``: no engine log-probs of the whole
        completions), and for an engine that returns none."""
        if self.engine.same_numerics or decoded is not None or completions.logps is None:
            return None
        return completions.logps.float() * rows["completion_mask"]

    def _sample_round(self, batch: dict[str, Any], seed: int, should_stop: Any = None) -> Round:
        """Sample one round's rows on the RNG seeded with ``seed``: ``self.rollouts``'s
        :meth:`~lit_trainer.generation.RolloutGenerator.sample_round` with this module's tools, environments and
        ``rollout_func`` (which gets the module as its second argument). The rollout worker process runs the same
        method of its own generator on its copy of the policy (:mod:`lit_trainer.modules.grpo._async`), so a round is
        the same computation in either process."""
        return self.rollouts.sample_round(
            self.model, batch, seed, device=self.device, tools=self.tools, environments=self.environments,
            rollout_func=self.rollout_func, caller=self, reduce=self._reduce(), owner=type(self).__name__,
            should_stop=should_stop,
        )  # fmt: skip

    def _buffer_round(self, rows: dict[str, Tensor], metrics: dict[str, Tensor]) -> None:
        """Shuffle the round's rows with a seeded generator, split them into micro-batches and buffer them with each
        micro-batch's completion-token count summed over ranks."""
        seed, round_index = self._seed, self._buffer.next_round_index
        shuffler = torch.Generator().manual_seed(rollout.rollout_seed(seed, round_index, self.global_rank, stream=1))
        slices = self._buffer.shuffle(rows, shuffler)
        tokens = torch.stack([s["completion_mask"].sum() for s in slices]).float()
        if self.trainer.world_size > 1:
            tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        self._buffer.fill(slices, tokens, metrics)

    def _gathered_scores(
        self, batch: dict[str, Any], completions: rollout.Completions, decoded: tuple | None, extra: Sequence = ()
    ) -> tuple[Tensor, int, list[Any], dict[str, Tensor]]:
        """Score this rank's rows and gather them over ranks: ``(table, number of reward functions, this rank's
        texts, the reward calls' logged metrics)``. The table's columns are the rewards (NaN = unscored), the
        completion length (``completions.mask``, the model's tokens), truncated (0/1), then ``extra`` ((rows, k)
        tensors of this rank), rank order.

        ``decoded``: ``(texts, kept ids, extra reward keywords)`` of an agentic round (else decoded here)."""
        if decoded is None:
            texts, kept = rollout.decode_completions(self.tokenizer, completions, is_conversational(batch[PROMPTS]))
            keywords = None
        else:
            texts, kept, keywords = decoded
        rewards, logged = score_completions(self, batch, texts, kept, keywords)
        lengths = completions.mask.sum(1, keepdim=True).float().to(self.device)
        truncated = completions.truncated.float().unsqueeze(1).to(self.device)
        table = self._gather_rows(torch.cat([rewards.to(self.device), lengths, truncated, *extra], dim=1))
        functions = rewards.shape[1]
        if torch.isnan(table[:, :functions]).all(dim=1).any():
            rank_zero_warn(
                "[lit_trainer] Every reward function returned None for some completions: their advantage is 0."
            )
        return table, functions, texts, logged

    def _record_completions(self, prompts: Sequence[Any], texts: Sequence[Any], rewards: Tensor, adv: Tensor) -> None:
        """Keep the round's table (rows of every rank, on rank 0) for ``log_completions``: prompt, completion, one
        column per reward function (NaN = unscored), advantage."""
        pairs = gather_from_all_ranks([(render_text(p), render_text(t)) for p, t in zip(prompts, texts)])
        if not self.trainer.is_global_zero:
            return
        pairs = [pair for rank in pairs for pair in rank]
        columns = ["prompt", "completion", *self.reward_names, "advantage"]
        values = torch.cat([rewards, adv.reshape(-1, 1).to(rewards)], dim=1).cpu().tolist()
        self.completion_table = (columns, [[p, c, *v] for (p, c), v in zip(pairs, values)])

    def _pad_token_id(self, eos: list[int]) -> int:
        """Padding id for generation (:meth:`~lit_trainer.generation.RolloutGenerator.pad_token_id`)."""
        return self.rollouts.pad_token_id(self.model, eos)

    def _reduce(self) -> Any:
        """``tensor -> its sum over ranks`` for the agentic rounds, None on one process."""
        if self.trainer.world_size == 1:
            return None
        return lambda t: self.trainer.strategy.reduce(t, reduce_op="sum")

    def _tool_round(self, batch: dict[str, Any], config: Any, eos: list[int], should_stop: Any = None) -> AgenticRound:
        """A tools / environments round of ``self.rollouts``
        (:meth:`~lit_trainer.generation.RolloutGenerator.tool_round`)."""
        options = self.rollouts.options
        return self.rollouts.tool_round(
            self.model, batch, config, eos, tools=list(self.tools), environments=self.environments,
            chat_template_kwargs=options.chat_template_kwargs,
            max_tool_calling_iterations=options.max_tool_calling_iterations,
            device=self.device, reduce=self._reduce(), owner=type(self).__name__, should_stop=should_stop,
        )  # fmt: skip

    def _chunked_logps(self, model: Any, rows: dict[str, Tensor]) -> Tensor:
        """Log-probs of the whole generation batch in chunks of one micro-batch (no grad)."""
        size = max(1, rows["prompt_ids"].shape[0] // self.rollout_geometry.steps_per_generation)
        return chunked_logps(lambda m, r: self.completion_logps(m, r)[0], model, rows, size)

    # -------------------------------------------------------------------------------------------- validation
    def _validation_completions(self, batch: dict[str, Any], config: Any, eos: list[int]) -> tuple:
        """``(texts, rewards, logged metrics)`` of one validation batch under ``config``; a stop request (a signal)
        cuts the generation short (the validation is then not logged, see :meth:`on_validation_epoch_end`)."""
        should_stop = stop_check(self.trainer)
        if self.agentic:  # the same multi-turn loop with tools
            agentic = self._tool_round(batch, config, eos, should_stop)
            texts, kept = agentic.texts, agentic.kept
            rewards, logged = score_completions(self, agentic_batch(batch, agentic), texts, kept, agentic.reward_kwargs)
            logged.update(agentic.tool_metrics)
            return texts, rewards, logged
        prompt_ids, prompt_mask = self._prompt_inputs(batch)
        images = vision_prompt.model_image_inputs(batch)
        completions = rollout.generate_completions(
            self.model, prompt_ids, prompt_mask, config, eos, _sharding.is_sharded(self.model), should_stop, images
        )
        texts, kept = rollout.decode_completions(self.tokenizer, completions, is_conversational(batch[PROMPTS]))
        rewards, logged = score_completions(self, batch, texts, kept)
        return texts, rewards, logged

    @override
    def on_validation_epoch_end(self) -> None:
        """Log the validation metrics, unless a stop request cut its generations short on some rank (all ranks
        agree): a validation of truncated completions is not logged, and the stopped run does not repeat it."""
        should_stop = stop_check(self.trainer)
        stopped = should_stop is not None and should_stop()
        if self.trainer.world_size > 1:
            flag = torch.tensor(float(stopped), device=self.device)
            stopped = bool(self.trainer.strategy.reduce(flag, reduce_op="sum") > 0)
        if stopped:
            self.val_metrics.reset()
            return
        super().on_validation_epoch_end()

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """One completion of each held-out prompt (greedy, or sampled with ``eval_do_sample``), scored by the reward
        functions (``val_reward``)."""
        eos = rollout.eos_token_ids(self.model, self.tokenizer)
        if self.hparams.eval_do_sample:
            config = self._sampling_config(eos)
            seed = torch.initial_seed() if self._seed is None else self._seed
            sampling = rollout.seeded_rng(
                rollout.rollout_seed(seed, batch_idx, self.global_rank, stream=2), self.device
            )
        else:
            config = GenerationConfig(
                max_new_tokens=self.hparams.max_completion_length,
                do_sample=False,
                pad_token_id=self._pad_token_id(eos),
                eos_token_id=eos,
                use_cache=True,
                **({"suppress_tokens": ids} if (ids := self._image_token_ids()) else {}),
            )
            sampling = contextlib.nullcontext()
        with sampling:
            texts, rewards, logged = self._validation_completions(batch, config, eos)
        for name, value in logged.items():
            self.log(f"val_{name}", value, on_epoch=True, sync_dist=True, batch_size=len(texts))
        rewards = rewards.to(self.device)
        weights = torch.as_tensor(self.reward_weights or [1.0] * rewards.shape[1], device=self.device)
        total = torch.nansum(rewards * weights, dim=1).masked_fill(torch.isnan(rewards).all(dim=1), float("nan"))
        self.val_metrics["reward"].update(total)
        for metric, column in zip(self._val_reward_means, rewards.T):
            metric.update(column)
