"""``chunked_logits``: the modules' losses, gradients and validation metrics equal the full-logits path.

Each comparison is calibrated (``tests/helpers/rounding.py``): the full path once in float32 and once in float64 gives
this computation's float32 rounding scale; the chunked float32 result must be within that of the full float32 one,
and a real mistake (the targets shifted by one position) must be far outside it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from datasets import Dataset

from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.modules.base import _logits
from lit_trainer.modules.causal_lm import CausalLMModule
from lit_trainer.modules.dpo import DPOModule

TEXTS = ["12+30=42", "a longer row of text to learn", "x", "mid row here", "7+8=15"]


def sft_batch(packing: bool = False) -> dict[str, torch.Tensor]:
    dm = SFTDataModule(
        tokenizer=transformers.ByT5Tokenizer(),
        dataset=Dataset.from_dict({"text": TEXTS}),
        val_size=0,
        batch_size=5,
        max_length=64,
        packing="bfd" if packing else "none",
        sampling="sequential",
    )
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def loss_and_grads(module: Any, batch: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    module = module.to(dtype)
    module.zero_grad()
    batch = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    loss, _ = module.compute_loss(batch, None)
    loss.backward()
    out = {"loss": loss.detach().reshape(1)}
    out |= {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return out


def sft(setting: str, **kwargs: Any) -> CausalLMModule:
    model = tiny_llama(0, eos_bias=2.0)  # an output bias: the chunked path must add it
    return CausalLMModule(model, tokenizer=transformers.ByT5Tokenizer(), chunked_logits=setting, **kwargs)


def shifted(batch: dict) -> dict:
    """The real mistake a wiring error makes: every target one position off."""
    return {**batch, "labels": batch["labels"].roll(1, -1)}


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("option", [{}, {"gradient_checkpointing": True}])
def test_sft_loss_and_gradients_equal_the_full_path(packing, option):
    batch = sft_batch(packing)
    assert ("position_ids" in batch) == packing
    full32 = loss_and_grads(sft("off", **option), batch, torch.float32)
    full64 = loss_and_grads(sft("off", **option), batch, torch.float64)
    chunked = loss_and_grads(sft("on", logits_chunk_size=7, **option), batch, torch.float32)
    mistake = relative_l2(loss_and_grads(sft("off", **option), shifted(batch), torch.float64), full64)
    Rounding.of(full32, full64, what="SFT loss and gradients").check(chunked, full32, mistake=mistake)


def test_sft_validation_metrics_equal_the_full_path():
    batch = sft_batch()
    results = {}
    for setting in ("off", "on"):
        module = sft(setting)
        module.validation_step(batch, 0)
        results[setting] = {k: module.val_metrics[k].compute() for k in ("loss", "token_accuracy")}
    assert results["on"]["token_accuracy"] == results["off"]["token_accuracy"]  # argmax hits: the same count
    # one mean of 30 float32 log-probs: rounding of order 1e-7 relative; a shifted target changes it by > 1e-1
    assert torch.allclose(results["on"]["loss"], results["off"]["loss"], rtol=1e-5, atol=0)


def test_lora_sft_matches_and_the_frozen_head_gets_no_gradient():
    pytest.importorskip("peft")
    batch = sft_batch()
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    full32 = loss_and_grads(sft("off", peft_config=lora), batch, torch.float32)
    full64 = loss_and_grads(sft("off", peft_config=lora), batch, torch.float64)
    chunked = loss_and_grads(sft("on", peft_config=lora), batch, torch.float32)
    assert set(chunked) == set(full32) and not any("lm_head" in k or "embed" in k for k in chunked)
    mistake = relative_l2(loss_and_grads(sft("off", peft_config=lora), shifted(batch), torch.float64), full64)
    Rounding.of(full32, full64, what="LoRA SFT").check(chunked, full32, mistake=mistake)


def dpo_batch() -> dict[str, torch.Tensor]:
    from lit_trainer.data.preference import PreferenceDataModule

    rows = {
        "prompt": ["12+30=", "7+8=", "1+1="],
        "chosen": ["42", "15", "2"],
        "rejected": ["41 or so", "16", "11"],
    }
    dm = PreferenceDataModule(
        tokenizer=transformers.ByT5Tokenizer(), dataset=Dataset.from_dict(rows), batch_size=3, val_size=0
    )
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def test_dpo_scores_and_loss_equal_the_full_path():
    batch = dpo_batch()
    results = {}
    for setting, dtype in (("off", torch.float32), ("off", torch.float64), ("on", torch.float32)):
        module = DPOModule(tiny_llama(0), tokenizer=transformers.ByT5Tokenizer(), chunked_logits=setting).to(dtype)
        scores = module.score(module.model, batch, stats=True)
        results[setting, dtype] = {"seq": scores.seq.detach(), "logits_mean": scores.logits_mean}
    full32, full64, chunked = results["off", torch.float32], results["off", torch.float64], results["on", torch.float32]
    wrong = {**full64, "seq": full64["seq"].roll(1)}  # rows mixed up
    mistake = relative_l2(wrong, full64)
    Rounding.of(full32, full64, what="DPO sequence log-probs").check(chunked, full32, mistake=mistake)


class ScaledLogits(transformers.LlamaForCausalLM):
    """Changes the logits after the head (as soft-capping models do): the chunked path must not be used."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_auto_uses_chunks_only_for_large_vocabularies_and_models_that_allow_it():
    small = tiny_llama(0)
    large = tiny_llama(0, hidden=16, vocab=32_000)
    assert not _logits.wants_chunked(small, "auto") and _logits.wants_chunked(small, "on")
    assert _logits.wants_chunked(large, "auto") and not _logits.wants_chunked(large, "off")
    scaled = ScaledLogits(tiny_llama(0, vocab=32_000, hidden=16).config)
    assert not _logits.supports_chunked(scaled) and not _logits.wants_chunked(scaled, "auto")
    with pytest.raises(ValueError, match="chunked_logits='on'.*use 'auto' or 'off'"):
        _logits.wants_chunked(scaled, "on")
    with pytest.raises(ValueError, match="chunked_logits='always'"):
        CausalLMModule(small, chunked_logits="always")


def test_a_large_vocabulary_takes_the_chunked_path_by_default_with_the_same_loss():
    torch.manual_seed(0)
    model = tiny_llama(0, hidden=16, vocab=32_000)
    batch = {
        "input_ids": torch.randint(0, 32_000, (2, 12)),
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
    }
    batch["labels"] = batch["input_ids"].clone()
    assert _logits.supports_chunked(model)  # the one-time probe (its forwards are not counted below)
    calls = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda mod, inp, out: calls.append(out.shape))
    auto = CausalLMModule(model)
    loss_auto, _ = auto.compute_loss(batch, None)
    assert calls == [(2, 12, 1)]  # the head returned 1 score per position, not 32,000 logits
    loss_full, _ = CausalLMModule(copy.deepcopy(model), chunked_logits="off").compute_loss(batch, None)
    assert calls[-1] == (2, 12, 32_000)
    # a mean of 22 float32 log-probs over 32,000 classes: rounding ~1e-6 relative; a mistake changes it by > 1e-2
    assert torch.allclose(loss_auto, loss_full, rtol=1e-5, atol=0)


def test_grpo_completion_logps_and_entropy_gradients_equal_the_full_path():
    from lit_trainer.modules.grpo import GRPOModule

    g = torch.Generator().manual_seed(0)
    rows = {
        "prompt_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),  # left-padded prompts
        "prompt_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        "completion_ids": torch.tensor([[11, 12, 1, 0], [13, 14, 15, 16]]),  # right-padded completions
        "completion_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
    }
    weights = torch.randn(2, 4, generator=g, dtype=torch.float64)

    def run(setting: str, dtype: torch.dtype, rows: dict) -> dict[str, torch.Tensor]:
        module = GRPOModule(
            tiny_llama(0, eos_bias=2.0),
            tokenizer=transformers.ByT5Tokenizer(),
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            temperature=0.7,
            chunked_logits=setting,
            logits_chunk_size=3,
        ).to(dtype)
        logps, entropy = module.completion_logps(module.model, rows, with_entropy=True, entropy_grad=True)
        mask = rows["completion_mask"].to(dtype)
        ((logps * weights.to(dtype) * mask).sum() + 0.3 * (entropy * mask).sum()).backward()
        out = {"logps": (logps * mask).detach(), "entropy": (entropy * mask).detach()}
        return out | {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    full32, full64 = run("off", torch.float32, rows), run("off", torch.float64, rows)
    chunked = run("on", torch.float32, rows)
    wrong_rows = {**rows, "completion_ids": rows["completion_ids"].roll(1, -1)}
    mistake = relative_l2(run("off", torch.float64, wrong_rows), full64)
    Rounding.of(full32, full64, what="GRPO log-probs, entropy, gradients").check(chunked, full32, mistake=mistake)
