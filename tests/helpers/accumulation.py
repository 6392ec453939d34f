"""Gradient accumulation tests, single-process and DDP: uneven rows and a full-batch reference."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from datasets import Dataset

from lit_trainer.data.sft import SFTDataModule
from lit_trainer.losses.causal_lm import causal_lm_loss

# 8 rows of very uneven length; with batch_size=2 and sequential order: micro-batches of 2 rows each
TEXTS = [
    "ab",
    "a long row with many many tokens in it, really long",
    "xyz",
    "mid-sized row here",
    "q",
    "another fairly long row of text to train on",
    "hi",
    "row 8 is short-ish",
]


def accum_datamodule(tokenizer, batch_size: int = 2, **kwargs) -> SFTDataModule:
    return SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS}),
        val_size=0,
        batch_size=batch_size,
        max_length=64,
        sampling=kwargs.pop("sampling", "sequential"),
        **kwargs,
    )


def full_batch_gradient(model: torch.nn.Module, dm: SFTDataModule, rows: list[int]) -> dict[str, torch.Tensor]:
    """Token-mean loss over ``rows`` in ONE forward, and its gradient."""
    batch = dm._collate([dm.train_dataset[i] for i in rows], True)
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    causal_lm_loss(out.logits, batch["labels"]).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


class GradCapture(pl.Callback):
    """Records the gradient seen right before each optimizer step (before clipping)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append(
            {
                n.removeprefix("model."): p.grad.detach().clone()
                for n, p in pl_module.named_parameters()
                if p.grad is not None
            }
        )


def fit_grads(module: pl.LightningModule, dm: pl.LightningDataModule, accumulate: int, max_steps: int) -> list:
    """Fit ``module`` on ``dm`` for ``max_steps`` optimizer steps of ``accumulate`` micro-batches (no validation,
    logging or checkpoints); the gradient seen before each optimizer step (see :class:`GradCapture`)."""
    capture = GradCapture()
    trainer = pl.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        callbacks=[capture],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=dm)
    return capture.grads


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(((a[k] - b[k]) ** 2).sum() for k in b)
    den = sum((b[k] ** 2).sum() for k in b)
    return float((num / den).sqrt())
