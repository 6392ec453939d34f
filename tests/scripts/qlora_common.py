"""Shared by ``tests/scripts/ddp_qlora.py`` (2 DDP ranks) and ``tests/test_qlora.py`` (one process): the QLoRA module,
data and trainer, identical in 1 and 2 processes."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

LORA = {"r": 32, "lora_alpha": 32, "target_modules": "all-linear"}  # r 32: every A/B has >= 4,096 values -> 8-bit state
STEPS = 3


def module(**overrides: Any) -> Any:
    """CausalLMModule on the ``tiny`` preset (seed 0) quantized to NF4, LoRA, 8-bit AdamW."""
    from lit_trainer import CausalLMModule

    pl.seed_everything(0, verbose=False)
    options = {"quantization": "nf4", "peft_config": LORA, "optim": "adamw_8bit", "learning_rate": 1e-2, **overrides}
    return CausalLMModule("tiny", **options)


def datamodule(batch_size: int, rows: int = 16) -> Any:
    from lit_trainer.data import SFTDataModule
    from lit_trainer.data.builtin import sft_rows

    data = sft_rows("train").select(range(rows))
    return SFTDataModule(tokenizer="tiny", dataset=data, batch_size=batch_size, max_length=16, sampling="sequential")


def trainer(devices: int = 1, strategy: str = "auto", accumulate: int = 1, **kwargs: Any) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy,
        "max_steps": STEPS,
        "accumulate_grad_batches": accumulate,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    return pl.Trainer(**{**options, **kwargs})


def adapter(module: Any) -> dict[str, torch.Tensor]:
    """The trainable (adapter) weights."""
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


def base_checksum(module: Any) -> float:
    """A float64 sum of the frozen base's stored values (packed 4-bit bytes included): changes if a base weight does."""
    return float(sum(p.detach().double().sum() for p in module.model.parameters() if not p.requires_grad))
