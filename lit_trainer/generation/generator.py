"""The rollout generator: the sampling options and the engine of GRPO/RLOO rounds, held by the module as
``self.rollouts`` and built the same way by the asynchronous rollout worker in its own process.

It reads no attribute of a LightningModule: the options come as a :class:`SamplingOptions`, the model and tokenizer
as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import GenerationConfig

from lit_trainer.generation import agentic, engines
from lit_trainer.generation.engines import Completions, RolloutEngine
from lit_trainer.models import is_vision_model


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling options of a round (GRPO's hyperparameters of the same names)."""

    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float | None
    repetition_penalty: float
    generation_kwargs: dict[str, Any] | None = None
    cache_implementation: str | None = None

    @classmethod
    def from_hparams(cls, hparams: Mapping[str, Any]) -> SamplingOptions:
        """The options read from a module's hyperparameters (or the worker's copy of them)."""
        return cls(**{f.name: hparams[f.name] for f in fields(cls)})


class RolloutGenerator:
    """Samples one round's completions: the sampling ``GenerationConfig`` of a model, then its :attr:`engine`
    (``generate``, continuous batching or a plug-in :class:`~lit_trainer.generation.engines.RolloutEngine`) on an RNG
    seeded for the round; or an agentic round (:meth:`tool_round`: tools and environments, multi-turn;
    :meth:`custom_round`: a ``rollout_func``), see :mod:`lit_trainer.generation.agentic`.

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
