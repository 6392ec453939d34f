"""The rollout generator: the sampling options and the engine of GRPO/RLOO rounds, held by the module as
``self.rollouts`` and built from the same inputs by the asynchronous rollout worker in its own process, where
:meth:`RolloutGenerator.sample_round` samples a round as the module does.

It reads no attribute of a LightningModule: the options come as a :class:`SamplingOptions`, the model, tokenizer,
tools and environments as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig

from lit_trainer.core import sharding
from lit_trainer.data.chat import render
from lit_trainer.data.prompt import PROMPT_IDS, PROMPT_MASK, PROMPTS
from lit_trainer.data.vision import prompt as vision_prompt
from lit_trainer.generation import agentic, engines
from lit_trainer.generation.engines import Completions, RolloutEngine
from lit_trainer.models import is_vision_model


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling options of a round (GRPO's hyperparameters of the same names): those of the
    ``GenerationConfig``, then those of :meth:`RolloutGenerator.sample_round` (``chat_template_kwargs``: template
    variables of conversational prompts and tool turns; ``max_tool_calling_iterations``; ``mask_truncated_completions``:
    completions without EOS leave the completion mask)."""

    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float | None
    repetition_penalty: float
    generation_kwargs: dict[str, Any] | None = None
    cache_implementation: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tool_calling_iterations: int | None = None
    mask_truncated_completions: bool = False

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> SamplingOptions:
        """The options read from a module's hyperparameters (GRPO's and RLOO's have every field)."""
        return cls(**{f.name: hparams[f.name] for f in fields(cls)})


class Round(NamedTuple):
    """One sampled round (:meth:`RolloutGenerator.sample_round`); a tuple, so it unpacks in this order."""

    #: ``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask`` (the loss mask), and per round kind
    #: ``completion_attention_mask`` (tool turns) or the rows' image inputs
    rows: dict[str, torch.Tensor]
    #: the model's completions (their ``mask`` counts the model's tokens, ``truncated``: no EOS)
    completions: Completions
    #: the batch the reward functions read (an agentic round adds its columns)
    batch: dict[str, Any]
    #: ``(texts, kept ids, extra reward keywords)`` of an agentic round; None: decode ``completions``
    decoded: tuple[Any, ...] | None
    #: the tool and environment metrics of an agentic round (empty otherwise)
    tool_metrics: dict[str, torch.Tensor]


class RolloutGenerator:
    """Samples one round's completions: the sampling ``GenerationConfig`` of a model, then its :attr:`engine`
    (``generate``, continuous batching or a plug-in :class:`~lit_trainer.generation.engines.RolloutEngine`) on an RNG
    seeded for the round; or an agentic round (:meth:`tool_round`: tools and environments, multi-turn;
    :meth:`custom_round`: a ``rollout_func``), see :mod:`lit_trainer.generation.agentic`. :meth:`sample_round` is a
    whole round, whichever kind: what GRPO/RLOO run in the training process and the rollout worker in its own.

    Args:
        engine: the engine that samples.
        options: the sampling options.
        tokenizer: the policy's tokenizer (its EOS and padding ids).
    """

    def __init__(self, engine: RolloutEngine, options: SamplingOptions, tokenizer: Any) -> None:
        self.engine = engine
        self.options = options
        self.tokenizer = tokenizer

    def pad_token_id(self, model: Any, eos: list[int]) -> int:
        """Padding id for generation: the model's generation config, else the tokenizer's, else the first EOS."""
        for pad in (model.generation_config.pad_token_id, getattr(self.tokenizer, "pad_token_id", None)):
            if pad is not None:
                return int(pad[0] if isinstance(pad, (list, tuple)) else pad)
        return eos[0]

    @staticmethod
    def image_token_ids(model: Any) -> list[int]:
        """A vision-language policy's image token id, never sampled (TRL 1.16 suppresses it whenever its processing
        class is a processor: a sampled image token has no image features); empty for a text model."""
        config = getattr(model, "config", None)
        if not is_vision_model(model):
            return []
        token = getattr(config, "image_token_id", None)
        token = getattr(config, "image_token_index", None) if token is None else token
        return [] if token is None else [int(token)]

    def eos_token_ids(self, model: Any) -> list[int]:
        """The ids that end a completion (the tokenizer's EOS and the model's generation-config EOS ids)."""
        return engines.eos_token_ids(model, self.tokenizer)

    def sampling_config(self, model: Any, eos: list[int]) -> GenerationConfig:
        """The ``GenerationConfig`` of the training rollouts (and of a sampled validation)."""
        o = self.options
        return engines.sampling_config(
            self.pad_token_id(model, eos), eos, max_completion_length=o.max_completion_length,
            temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
            repetition_penalty=o.repetition_penalty, generation_kwargs=o.generation_kwargs,
            cache_implementation=o.cache_implementation, suppress_tokens=self.image_token_ids(model),
        )  # fmt: skip

    def generate(
        self,
        model: Any,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: GenerationConfig,
        eos: list[int],
        *,
        seed: int | None = None,
        device: torch.device | None = None,
        synced: bool = False,
        should_stop: Callable[[], bool] | None = None,
        images: Mapping[str, Any] | None = None,
    ) -> Completions:
        """Sample one completion per prompt row with the engine; with ``seed``, on the CPU (and ``device``'s CUDA)
        RNG seeded with it, restored afterwards (:func:`~lit_trainer.generation.engines.seeded_rng`).

        ``images``: a vision-language model's image inputs (``pixel_values``, ...), passed to the engine."""
        extra = dict(images or {})
        if seed is None:
            return self.engine.generate(
                model, prompt_ids, prompt_mask, config, eos, synced=synced, should_stop=should_stop, **extra
            )
        with engines.seeded_rng(seed, device if device is not None else prompt_ids.device):
            return self.engine.generate(
                model, prompt_ids, prompt_mask, config, eos, synced=synced, should_stop=should_stop, **extra
            )

    def prompt_rows(self, prompt_ids: list[list[int]], device: Any) -> dict[str, torch.Tensor]:
        """Left-padded ``prompt_ids`` and ``prompt_mask`` of token lists, on ``device``."""
        return agentic.prompt_rows(self.tokenizer, prompt_ids, device)

    def tool_round(
        self,
        model: Any,
        batch: Mapping[str, Any],
        config: GenerationConfig,
        eos: list[int],
        *,
        tools: list[Any],
        environments: Any,
        chat_template_kwargs: dict[str, Any] | None,
        max_tool_calling_iterations: int | None,
        device: Any,
        reduce: agentic.Reduce | None = None,
        owner: str = "GRPOModule",
        should_stop: Callable[[], bool] | None = None,
    ) -> agentic.AgenticRound:
        """A round with ``tools`` and ``environments``: render, generate, call the tools and continue, all rows
        together (:func:`~lit_trainer.generation.agentic.tool_round`), with this generator's engine and
        ``max_completion_length``. ``reduce`` sums a tensor over ranks (None on one process)."""
        return agentic.tool_round(
            self.engine, model, self.tokenizer, dict(batch), config, eos, tools=tools, environments=environments,
            chat_template_kwargs=chat_template_kwargs, max_tool_calling_iterations=max_tool_calling_iterations,
            max_completion_length=self.options.max_completion_length, device=device, reduce=reduce, owner=owner,
            should_stop=should_stop,
        )  # fmt: skip

    def custom_round(
        self,
        rollout_func: Callable[..., Any],
        caller: Any,
        batch: Mapping[str, Any],
        eos: list[int],
        pad: int,
        *,
        tools: list[Any],
        device: Any,
    ) -> agentic.AgenticRound:
        """A round from the user's ``rollout_func(prompts, caller)``
        (:func:`~lit_trainer.generation.agentic.custom_round`)."""
        return agentic.custom_round(
            rollout_func, caller, self.tokenizer, dict(batch), eos, pad, tools=tools, device=device
        )

    def prompt_inputs(self, batch: Mapping[str, Any], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask for the engine: the data module's, or, for conversational prompts with
        ``chat_template_kwargs``, the prompts rendered again with them (TRL 1.16 renders its prompts with
        ``GRPOConfig.chat_template_kwargs``; the data module does not know the module's options)."""
        options, prompts = self.options.chat_template_kwargs, batch[PROMPTS]
        if not options or not _conversational(prompts):
            return batch[PROMPT_IDS], batch[PROMPT_MASK]
        rows = self.prompt_rows(
            [render(self.tokenizer, p, add_generation_prompt=True, **options) for p in prompts], device
        )
        return rows["prompt_ids"], rows["prompt_mask"]

    def sample_round(
        self,
        model: Any,
        batch: Mapping[str, Any],
        seed: int,
        *,
        device: Any,
        tools: Sequence[Any] = (),
        environments: Any = None,
        rollout_func: Callable[..., Any] | None = None,
        caller: Any = None,
        reduce: agentic.Reduce | None = None,
        owner: str = "GRPOModule",
        should_stop: Callable[[], bool] | None = None,
    ) -> Round:
        """Sample one round's rows on the RNG seeded with ``seed`` (CPU and ``device``'s CUDA, restored afterwards):
        a ``rollout_func`` round, a tools / environments round, or the engine on the prompts (with the rows' images).
        With ``mask_truncated_completions`` truncated completions leave the completion mask here, before any log-prob.

        Args:
            model: the policy that samples.
            batch: the prompt batch (``prompts``, ``prompt_input_ids``, ``prompt_attention_mask``, reward columns,
                image inputs).
            seed: the round's seed (:func:`~lit_trainer.generation.engines.rollout_seed`).
            device: where the rows are built.
            tools: the tool functions (a tools round when any, or with ``environments``).
            environments: the :class:`~lit_trainer.generation.agentic.environments.Environments` of the run, or None.
            rollout_func: replaces generation: ``rollout_func(prompts, caller)``.
            caller: ``rollout_func``'s second argument (GRPO passes the module).
            reduce: sums a tensor over ranks for the tool metrics (None on one process).
            owner: the class named in the agentic rounds' messages.
            should_stop: a stop request may end the generation early when it turns True.
        """
        o = self.options
        prompt_ids, prompt_mask = self.prompt_inputs(batch, device)
        eos = self.eos_token_ids(model)
        config = self.sampling_config(model, eos)
        with_tools = bool(tools) or environments is not None
        images = {k: batch[k] for k in vision_prompt.row_image_keys(batch)}  # per row (refused with custom rounds)
        with engines.seeded_rng(seed, device):
            if rollout_func is not None:
                custom = self.custom_round(
                    rollout_func, caller, batch, eos, config.pad_token_id, tools=list(tools), device=device
                )
            elif with_tools:
                custom = self.tool_round(
                    model, batch, config, eos, tools=list(tools), environments=environments,
                    chat_template_kwargs=o.chat_template_kwargs, device=device, reduce=reduce, owner=owner,
                    max_tool_calling_iterations=o.max_tool_calling_iterations, should_stop=should_stop,
                )  # fmt: skip
            else:
                completions = self.generate(
                    model,
                    prompt_ids,
                    prompt_mask,
                    config,
                    eos,
                    synced=sharding.is_sharded(model),
                    should_stop=should_stop,
                    images=vision_prompt.model_image_inputs(images),
                )
        if rollout_func is not None or with_tools:
            rows, completions = custom.rows, custom.completions
            scoring, decoded = agentic.agentic_batch(batch, custom), (custom.texts, custom.kept, custom.reward_kwargs)
            tool_metrics = custom.tool_metrics
        else:
            rows = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completions.ids}
            rows["completion_mask"] = completions.mask
            rows.update(images)  # the image inputs follow their rows through the buffer's shuffle
            scoring, decoded, tool_metrics = batch, None, {}
        if o.mask_truncated_completions:
            kept = (~completions.truncated).unsqueeze(1).to(rows["completion_mask"])  # its dtype and device
            rows["completion_mask"] = rows["completion_mask"] * kept
        return Round(rows, completions, scoring, decoded, tool_metrics)


def _conversational(prompts: Sequence[Any]) -> bool:
    """Whether a batch's prompts are conversations (lists of messages) rather than strings."""
    return bool(prompts) and not isinstance(prompts[0], str)
