"""Shared by the sharded (FSDP2) scripts and tests: data, trainers and recorders, identical in 1 and 2 processes."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from datasets import Dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from conftest import tiny_llama  # noqa: E402

from lit_trainer.modules import _sharding  # noqa: E402

# 16 rows of uneven length: per-device batch 2 x 2 ranks x accumulate 2 = 8 rows per optimizer step (2 per epoch)
TEXTS = [("short " if i % 3 else "a much longer row of text with many more tokens in it ") * (1 + i % 4)
         for i in range(16)]
STEPS, ACCUMULATE, MAX_GRAD_NORM = 20, 2, 0.05
DPO_STEPS = 10


def sft_datamodule(tokenizer: Any, batch_size: int) -> Any:
    from lit_trainer.data.sft import SFTDataModule

    return SFTDataModule(tokenizer=tokenizer, dataset=Dataset.from_dict({"text": TEXTS}), val_size=0,
                         batch_size=batch_size, max_length=64, sampling="sequential")


def dpo_datamodule(tokenizer: Any, batch_size: int) -> Any:
    from lit_trainer.data import builtin
    from lit_trainer.data.preference import PreferenceDataModule

    return PreferenceDataModule(tokenizer=tokenizer, dataset=builtin.preference_rows("train").select(range(16)),
                                val_size=0, batch_size=batch_size, max_length=32, sampling="sequential")


def model_parallel(devices: int = 2) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)


def trainer(strategy: Any, devices: int, max_steps: int, callbacks: list, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", strategy=strategy, devices=devices, max_steps=max_steps,
                      accumulate_grad_batches=ACCUMULATE, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, **kwargs)


def full_weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The policy's full weights on every rank (a collective under sharding)."""
    return {n: _sharding.full(p.detach()).clone().cpu() for n, p in module.model.named_parameters()}


class ClipRecorder(pl.Callback):
    """Records, per optimizer step, the module's pre-clipping norm and the norm of the gradients the optimizer stepped
    with (read at the step's end, before the next window zeroes them)."""

    def __init__(self) -> None:
        self.pre: list[float] = []
        self.post: list[float] = []
        self._step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self._step:
            return
        self._step = trainer.global_step
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.post.append(float(_sharding.full(torch.nn.utils.get_total_norm(grads))))
        self.pre.append(float(pl_module._grad_norm))
