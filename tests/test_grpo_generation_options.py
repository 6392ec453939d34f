"""GRPOModule's generation options: ``cache_implementation`` and transformers' continuous batching
(``use_transformers_continuous_batching``, the deprecated ``use_transformers_paged``), with seeded sampling kept."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import transformers
from datasets import Dataset
from test_grpo_module import QUIET, length_reward

from helpers.models import tiny_llama
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.generation import engines as rollout
from lit_trainer.modules.grpo import GRPOModule

# a paged cache of 16 blocks: the engine's default sizes it from the free memory (half of it), slow to allocate on CPU
SMALL_CACHE = {"num_blocks": 16, "max_batch_tokens": 256}


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    enc = transformers.ByT5Tokenizer()(
        ["10+11=", "123+4=", "7+8="] * 2, padding=True, padding_side="left", add_special_tokens=False
    )  # no trailing EOS, as the module drops it
    return torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"])


def _config(**kwargs: Any) -> Any:
    options = {"max_completion_length": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None}
    return rollout.sampling_config(0, [1], repetition_penalty=1.0, **{**options, **kwargs})


def test_static_cache_samples_the_same_completions_as_the_default_cache():
    model, (ids, mask) = tiny_llama(0, eos_bias=3.0), _prompts()
    config = _config(cache_implementation="static")
    assert config.cache_implementation == "static" and config.disable_compile  # no torch.compile on the way
    runs = {}
    for cache in (None, "static"):
        with rollout.seeded_rng(5, torch.device("cpu")):
            runs[cache] = rollout.generate_completions(model, ids, mask, _config(cache_implementation=cache), [1])
    assert torch.equal(runs[None].ids, runs["static"].ids) and torch.equal(runs[None].mask, runs["static"].mask)
    assert runs[None].mask.sum(1).unique().numel() > 1  # lengths vary: EOS is sampled in some rows


@pytest.mark.slow
def test_continuous_batching_is_seeded_and_greedy_equals_generate():
    model, (ids, mask) = tiny_llama(0, eos_bias=3.0), _prompts()
    runs = []
    for seed in (5, 5, 6):
        with rollout.seeded_rng(seed, torch.device("cpu")):
            runs.append(rollout.generate_completions_continuous(model, ids, mask, _config(), [1], SMALL_CACHE))
    assert torch.equal(runs[0].ids, runs[1].ids) and not torch.equal(runs[0].ids, runs[2].ids)
    assert model.training  # the engine's eval() is undone
    greedy, model = _config(generation_kwargs={"do_sample": False}), tiny_llama(0)  # no EOS bias: EOS is not argmax
    plain = rollout.generate_completions(model, ids, mask, greedy, [1])
    paged = rollout.generate_completions_continuous(model, ids, mask, greedy, [1], SMALL_CACHE)
    assert torch.equal(plain.mask, paged.mask)
    assert torch.equal(plain.ids[plain.mask.bool()], paged.ids[paged.mask.bool()])
    assert plain.mask.sum() > plain.mask.shape[0]  # more than one token per row


def _module(**kwargs: Any) -> GRPOModule:
    return GRPOModule(
        tiny_llama(0, eos_bias=3.0), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward],
        num_generations=4, max_completion_length=4, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0,
        generation_seed=0, **kwargs,
    )  # fmt: skip


def _data() -> PromptDataModule:
    prompts = Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(8)]})
    return PromptDataModule(
        tokenizer=transformers.ByT5Tokenizer(), dataset=prompts, batch_size=8, max_length=16, val_size=0,
        sampling="sequential",
    )  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"cache_implementation": "static"},
        pytest.param(
            {"use_transformers_continuous_batching": True, "transformers_continuous_batching_config": SMALL_CACHE},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_fit_with_a_generation_option_is_reproducible(options):
    """Two fits with the same seed train on the same completions and end with equal weights."""
    modules = []
    for _ in range(2):
        module = _module(**options)
        L.Trainer(max_steps=2, **QUIET).fit(module, datamodule=_data())
        modules.append(module)
    assert modules[0].continuous_batching == bool(options.get("use_transformers_continuous_batching"))
    for (name, a), (_, b) in zip(modules[0].state_dict().items(), modules[1].state_dict().items()):
        assert torch.equal(a, b), name
    assert not torch.equal(modules[0].model.lm_head.bias, tiny_llama(0, eos_bias=3.0).lm_head.bias)  # it trained


def test_paged_is_a_deprecated_alias_and_bad_settings_are_refused():
    with pytest.warns(FutureWarning, match="use_transformers_continuous_batching=True"):
        assert _module(use_transformers_paged=True).continuous_batching
    with pytest.raises(ValueError, match=r"cache_implementation='bogus'.*choose one of"):
        _module(cache_implementation="bogus")
    with pytest.raises(ValueError, match="own paged cache: set cache_implementation=None"):
        _module(cache_implementation="static", use_transformers_continuous_batching=True)
