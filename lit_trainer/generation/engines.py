"""Rollout engines and the small pieces of sampling: sample completions in one batched ``generate`` call, cut them
after EOS, decode and measure them.

The extension point is :class:`RolloutEngine`, the one small interface through which GRPO and RLOO sample, with
:class:`GenerateEngine` (transformers' ``generate``, the default) and :class:`ContinuousBatchingEngine`
(transformers' continuous batching). The synchronous module calls its engine in the training process; with
``max_staleness`` set, the rollout worker process (:mod:`lit_trainer.modules.grpo._async`) calls the same engine on its
own copy of the policy. A third-party engine (vLLM, SGLang: docs/grpo_async.md) subclasses :class:`RolloutEngine`, is
named by import path in ``GRPOModule(rollout_engine=...)`` and runs in the worker; it declares ``same_numerics =
False`` so the trainer corrects every round, not only stale ones.

Small functions used by :class:`~lit_trainer.modules.grpo.GRPOModule` (TRL's generation and metrics,
docs/design.md#trl-grpo). Nothing here knows about Lightning; scoring and advantages live in
:mod:`lit_trainer.losses.grpo` and :mod:`lit_trainer.rewards`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from lightning.pytorch import Callback
from torch import Tensor
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from lit_trainer.core.seeding import derive_seed


class Completions(NamedTuple):
    """Completions of one generation batch, right-padded.

    ``ids``: (R, C) token ids (pad after the first EOS); ``mask``: (R, C) 1 on kept tokens (EOS included);
    ``truncated``: (R,) bool, True when no EOS was produced within ``max_completion_length``.
    ``logps``: (R, C) the engine's own log-probs of the tokens (0 off the mask), from an engine that computes them
    while sampling (vLLM); None otherwise.
    """

    ids: Tensor
    mask: Tensor
    truncated: Tensor
    logps: Tensor | None = None


def rollout_seed(seed: int, round_index: int, rank: int, stream: int = 0) -> int:
    """A 63-bit seed for one generation round on one rank (``stream`` 0 = sampling, 1 = buffer shuffle).

    A hash, so every (round, rank, stream) gets an unrelated stream, and a resumed run regenerates the same one.
    """
    return derive_seed(seed, round_index, rank, stream)


@contextmanager
def seeded_rng(seed: int, device: torch.device):
    """Run the block on the CPU (and ``device``'s CUDA) RNG seeded with ``seed``, then restore the previous states.

    ``generate`` samples from the global RNG; forking it keeps sampling reproducible per round and leaves the
    training stream (dropout, data order) exactly where it was.
    """
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        yield


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (reference: both end a completion)."""
    ids: list[int] = []
    for value in (getattr(tokenizer, "eos_token_id", None), model.generation_config.eos_token_id):
        for eos in value if isinstance(value, (list, tuple)) else [value]:
            if eos is not None and int(eos) not in ids:
                ids.append(int(eos))
    if not ids:
        raise ValueError(
            "Neither the tokenizer nor the model's generation_config has an EOS token id: GRPO needs one "
            "to end completions. Set `tokenizer.eos_token` or `model.generation_config.eos_token_id`."
        )
    return ids


def sampling_config(
    pad_token_id: int,
    eos_ids: list[int],
    *,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float | None,
    repetition_penalty: float,
    generation_kwargs: dict[str, Any] | None = None,
    cache_implementation: str | None = None,
    suppress_tokens: list[int] | None = None,
) -> GenerationConfig:
    """The sampling ``GenerationConfig`` of the reference's transformers path (``generation_kwargs`` win).

    As the reference, ``disable_compile=True``: a static cache would otherwise make ``generate`` compile the forward.
    ``suppress_tokens``: ids never sampled (a vision-language model's image token, as the reference: a sampled image
    token would have no image features).
    """
    options = {
        "max_new_tokens": max_completion_length, "do_sample": True, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty, "pad_token_id": pad_token_id,
        "eos_token_id": eos_ids, "use_cache": True, "cache_implementation": cache_implementation,
        "disable_compile": True,
    }  # fmt: skip
    if suppress_tokens:
        options["suppress_tokens"] = list(suppress_tokens)
    options.update(generation_kwargs or {})
    return GenerationConfig(**options)


def cut_after_eos(ids: Tensor, eos_ids: Sequence[int], pad_token_id: int) -> Completions:
    """Keep each row up to and including its first EOS; pad the rest (as TRL's GRPOTrainer).

    Args:
        ids: (R, C) generated tokens (everything after the prompt).
        eos_ids: ids that end a completion.
        pad_token_id: written after the first EOS.

    Returns:
        :class:`Completions`. Example: eos=1, ``[[5, 1, 7], [5, 6, 7]]`` -> mask ``[[1, 1, 0], [1, 1, 1]]``, ids
        ``[[5, 1, pad], [5, 6, 7]]``, truncated ``[False, True]``.
    """
    is_eos = torch.isin(ids, torch.as_tensor(list(eos_ids), device=ids.device))
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, ids.shape[1], dtype=torch.long))
    positions = torch.arange(ids.shape[1], device=ids.device)
    mask = (positions[None, :] <= first[:, None]).long()
    return Completions(ids.masked_fill(mask == 0, pad_token_id), mask, ~has_eos)


class StopWhen(StoppingCriteria):
    """A stopping criterion that ends every row once ``check()`` is True (read after each generated token): a stop
    request (a signal, :mod:`lit_trainer.core.stop_request`) ends a generation within one forward pass. While the check
    is False it changes nothing, so the tokens are the same as without it."""

    def __init__(self, check: Callable[[], bool]) -> None:
        self.check = check

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        return torch.full((input_ids.shape[0],), bool(self.check()), dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate_completions(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    config: GenerationConfig,
    eos_ids: Sequence[int],
    synced: bool = False,
    should_stop: Callable[[], bool] | None = None,
    image_inputs: dict[str, Tensor] | None = None,
) -> Completions:
    """One batched ``generate`` call (KV cache, left-padded prompts) and the EOS cut.

    ``image_inputs``: the prompts' image inputs for a vision-language model (``pixel_values``, ...;
    :func:`~lit_trainer.data.vision.prompt.model_image_inputs`), passed to ``generate`` with the ids.

    The model is NOT switched to eval mode (as the reference); ``no_grad`` also keeps NEFTune noise off. ``synced``
    (sharded weights: every forward is a collective) makes a rank whose rows have all stopped keep running forwards
    until every rank has stopped (transformers' ``synced_gpus``), so ranks generating different lengths stay in step.
    ``should_stop``: ends the generation early once it is True (:class:`StopWhen`); the caller drops the result.
    """
    criteria = StoppingCriteriaList([StopWhen(should_stop)]) if should_stop is not None else None
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=config,
        synced_gpus=synced,
        stopping_criteria=criteria,
        **(image_inputs or {}),
    )
    completion = out[:, prompt_ids.shape[1] :]
    if completion.shape[1] == 0:  # every row stopped at once (cannot happen with max_new_tokens >= 1)
        completion = torch.full_like(prompt_ids[:, :1], config.pad_token_id)
    return cut_after_eos(completion, eos_ids, config.pad_token_id)


@torch.no_grad()
def generate_completions_continuous(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    config: GenerationConfig,
    eos_ids: Sequence[int],
    batching_options: dict[str, Any] | None = None,
) -> Completions:
    """transformers' continuous-batching engine (``generate_batch``, paged KV cache) instead of ``generate``.

    The prompts go in without their left padding; the completions come back in prompt order, are right-padded and
    cut after EOS as :func:`generate_completions`. The engine samples from the global RNG (which the caller seeds),
    so a round is reproducible as long as its scheduler is (it is on one CPU process). ``batching_options`` are
    ``ContinuousBatchingConfig`` fields (``max_memory_percent`` defaults to 0.5 as the reference, to leave memory for
    training); ``seed`` is left unset so the engine draws it from the seeded RNG. The model's train/eval mode is
    restored afterwards.
    """
    from transformers.generation import ContinuousBatchingConfig

    options = {"max_memory_percent": 0.5, **(batching_options or {})}
    prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
    training = model.training
    try:
        outputs = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(**options),
            progress_bar=False,
        )
    finally:
        model.train(training)
    generated = [list(out.generated_tokens)[: config.max_new_tokens] for out in outputs.values()]
    if len(generated) != len(prompts):
        raise RuntimeError(f"Continuous batching returned {len(generated)} completions for {len(prompts)} prompts.")
    width = max(1, max(len(g) for g in generated))
    ids = torch.full((len(generated), width), config.pad_token_id, dtype=torch.long)
    for i, tokens in enumerate(generated):
        ids[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    return cut_after_eos(ids.to(prompt_ids.device), eos_ids, config.pad_token_id)


def decode_completions(tokenizer: Any, completions: Completions, conversational: bool) -> tuple[list, list[list[int]]]:
    """Decoded completions for the reward functions, and the kept ids as lists.

    Standard prompts get ``batch_decode(skip_special_tokens=True)`` strings; conversational prompts get
    ``[{"role": "assistant", "content": text}]``, as the reference.
    """
    kept = [row[m.bool()].tolist() for row, m in zip(completions.ids.cpu(), completions.mask.cpu())]
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    if conversational:
        return [[{"role": "assistant", "content": t}] for t in texts], kept
    return texts, kept


def completion_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, Tensor]:
    """``completions/*`` metrics of one (gathered) generation batch (TRL's GRPO metrics), 0-dim float tensors.

    Args:
        lengths: (R,) kept tokens per completion (EOS included), before truncation masking.
        truncated: (R,) bool.

    Returns:
        mean/min/max length, the clipped (truncated) ratio, and mean/min/max over terminated completions only (0 if
        there are none).
    """
    lengths = lengths.float()
    done = lengths[~truncated]
    empty = lengths.new_zeros(())
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.float().mean(),
        "completions/mean_terminated_length": done.mean() if done.numel() else empty,
        "completions/min_terminated_length": done.min() if done.numel() else empty,
        "completions/max_terminated_length": done.max() if done.numel() else empty,
    }


# ------------------------------------------------------------------------------------------------ engines
class RolloutEngine:
    """How a round's completions are sampled, and how new weights reach the sampling model.

    Subclasses override :meth:`generate`, and :meth:`load_weights` when the model is not an ``nn.Module`` whose
    parameter names are the trainer's (a vLLM engine maps them to its own).

    Attributes:
        same_numerics: the engine's log-probs are computed by the trainer's own code (the worker scores the
            completions with the trainer's forward), so a round generated by the current weights is exactly on-policy
            and needs no correction. An engine with its own kernels sets False.
    """

    same_numerics: bool = True

    def generate(
        self,
        model: Any,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        config: GenerationConfig,
        eos_ids: Sequence[int],
        *,
        synced: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> Completions:
        """Sample one completion per prompt row from the global RNG (the caller seeds it).

        Args:
            model: the sampling model.
            prompt_ids: (R, P) left-padded prompt ids.
            prompt_mask: (R, P) their attention mask.
            config: the sampling ``GenerationConfig`` (``max_new_tokens``, temperature, ...).
            eos_ids: the ids that end a completion.
            synced: the weights are sharded (every forward is a collective; keep ranks in step).
            should_stop: a stop request; when it turns True the engine may return early (the caller drops the result).

        Returns:
            Right-padded completions cut after the first EOS.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds outside the model (a server process); called when fitting ends or fails
        (:class:`CloseEngines`). The engine may be used again afterwards (it starts what it needs again)."""

    def check_fit(self, owner: str, longest_prompt: int | None, max_new_tokens: int) -> None:
        """Refuse, before training starts, what the engine cannot sample (called at the module's ``setup("fit")``):
        ``longest_prompt`` tokens of the data (None when the data module does not say) plus ``max_new_tokens``.
        ``owner`` is the module class the message names. Nothing by default.

        Raises:
            ValueError: the engine cannot serve this fit (the message names the value and the fix).
        """

    @torch.no_grad()
    def load_weights(self, model: Any, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy ``(parameter name, tensor)`` pairs into ``model``'s parameters of the same names.

        Raises:
            KeyError: a name the model does not have (the message names it).
        """
        params = dict(model.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"the sampling model has no parameter {name!r} to load a synced weight into.")
            params[name].copy_(tensor)


class GenerateEngine(RolloutEngine):
    """One batched ``model.generate`` call (:func:`~lit_trainer.generation.engines.generate_completions`)."""

    def generate(self, model, prompt_ids, prompt_mask, config, eos_ids, *, synced=False, should_stop=None, **images):
        """``images``: the prompts' image inputs for a vision-language model (``pixel_values``, ...)."""
        return generate_completions(model, prompt_ids, prompt_mask, config, eos_ids, synced, should_stop, images)


class ContinuousBatchingEngine(RolloutEngine):
    """transformers' continuous batching
    (:func:`~lit_trainer.generation.engines.generate_completions_continuous`).

    Args:
        options: ``transformers.ContinuousBatchingConfig`` fields (``max_memory_percent`` defaults to 0.5).
    """

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = options

    def generate(self, model, prompt_ids, prompt_mask, config, eos_ids, *, synced=False, should_stop=None):
        # the engine has no stopping criteria: a stop request waits for the batch to finish
        return generate_completions_continuous(model, prompt_ids, prompt_mask, config, eos_ids, self.options)


#: short names of ``rollout_engine``
ENGINE_NAMES = {"vllm": "lit_trainer.generation.vllm.VLLMEngine"}


class CloseEngines(Callback):
    """Closes rollout engines when fitting fails: Lightning calls no LightningModule hook on an exception, so an
    engine's server (vLLM) would otherwise run, and its weights stay in shared memory, until the interpreter exits (a
    notebook, a sweep). The modules' ``teardown`` closes them when fitting ends."""

    def __init__(self, *engines: RolloutEngine) -> None:
        self.engines = engines

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        for engine in self.engines:
            engine.close()


def close_on_failure(*engines: RolloutEngine) -> list[Callback]:
    """What a module's ``configure_callbacks`` adds for its engines: a :class:`CloseEngines` for those that hold
    something outside the model (they override :meth:`RolloutEngine.close`), nothing when none does."""
    holding = [e for e in engines if type(e).close is not RolloutEngine.close]
    return [CloseEngines(*holding)] if holding else []


def make_engine(
    continuous_batching: bool,
    options: dict[str, Any] | None,
    custom: str | None = None,
    custom_options: dict[str, Any] | None = None,
) -> RolloutEngine:
    """The engine the options name: ``custom`` ("vllm", or an import path of a :class:`RolloutEngine` subclass, built
    with ``custom_options`` as keyword arguments), else continuous batching or ``generate``.

    Raises:
        ValueError: ``custom`` does not import, or is not a RolloutEngine subclass; ``custom_options`` without
            ``custom``.
    """
    if custom is None and custom_options:
        raise ValueError(
            f"rollout_engine_options={custom_options!r} without rollout_engine: name the engine they are for "
            "(rollout_engine='vllm'), or leave them unset."
        )
    if custom is not None:
        from lit_trainer.core.import_path import import_object

        if custom not in ENGINE_NAMES and "." not in custom:
            raise ValueError(
                f"rollout_engine={custom!r} is not an engine: use one of {sorted(ENGINE_NAMES)}, or the import path "
                "'package.module.Class' of a RolloutEngine subclass."
            )
        path = ENGINE_NAMES.get(custom, custom)
        cls = import_object(
            path, "rollout_engine", "give 'vllm' or 'package.module.Class' of a RolloutEngine subclass."
        )
        if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
            raise ValueError(
                f"rollout_engine {custom!r} is not a RolloutEngine subclass: subclass "
                "lit_trainer.modules.grpo.RolloutEngine and override generate()."
            )
        try:
            return cls(**(custom_options or {}))
        except TypeError as error:
            raise ValueError(f"rollout_engine_options={custom_options!r} do not fit {path}: {error}") from None
    return ContinuousBatchingEngine(options) if continuous_batching else GenerateEngine()
