"""Shared by ``tests/scripts/fsdp_lora.py`` (2 sharded ranks) and ``tests/test_fsdp_lora.py`` (one process): LoRA
modules, data and readers, identical in 1 and 2 processes."""

from __future__ import annotations

from typing import Any

import _fsdp_common as common
import torch
from transformers import ByT5Tokenizer

from helpers.models import tiny_llama
from lit_trainer.core import sharding as _sharding

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
SFT_STEPS, DPO_STEPS, GRPO_STEPS = 4, 4, 2
PROBE = torch.tensor([[3, 10, 20, 30, 40, 50, 60, 70]])  # token ids the exported adapter is scored on


def sft_module(seed: int = 1) -> Any:
    """CausalLMModule with a new LoRA adapter on a seeded tiny Llama (the adapter's random init follows the seed)."""
    from lit_trainer.modules.causal_lm import CausalLMModule

    return CausalLMModule(
        tiny_llama(seed=seed, layers=2),
        tokenizer=ByT5Tokenizer(),
        peft_config=LORA,
        learning_rate=1e-2,
        max_grad_norm=common.MAX_GRAD_NORM,
    )


def sft_datamodule(batch_size: int) -> Any:
    return common.sft_datamodule(ByT5Tokenizer(), batch_size)


def dpo_module() -> Any:
    """DPOModule with LoRA: no reference copy, the reference is the policy with its adapters disabled."""
    from lit_trainer.modules.dpo import DPOModule

    return DPOModule(
        tiny_llama(seed=2, layers=2),
        tokenizer=ByT5Tokenizer(),
        peft_config=LORA,
        loss_type=["sigmoid", "sft"],
        learning_rate=1e-2,
        beta=0.1,
        max_grad_norm=1.0,
    )


def adapter_weights(module: Any) -> dict[str, torch.Tensor]:
    """The trainable (adapter) weights, full tensors on every rank (a collective under sharding)."""
    return {n: _sharding.full(p.detach()).clone().cpu() for n, p in module.model.named_parameters() if p.requires_grad}


@torch.no_grad()
def probe_logits(model: Any) -> torch.Tensor:
    """The model's logits on :data:`PROBE` in eval mode (every rank must call it under sharding)."""
    training = model.training
    model.eval()
    logits = model(input_ids=PROBE).logits.float().cpu()
    model.train(training)
    return logits


def grpo_run(strategy: Any, precision: str) -> tuple[Any, list[int], dict[str, torch.Tensor]]:
    """GRPO with LoRA and ``beta=0.04`` (the reference: adapters disabled) on the shared GRPO task."""
    module, longest, _, initial = common.grpo_run(strategy, precision, steps=GRPO_STEPS, peft_config=LORA)
    return module, longest, initial
