"""Gradient accumulation tests, single-process and DDP: uneven rows and a full-batch reference."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from datasets import Dataset

from helpers.rounding import Rounding, relative_l2
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


relative_error = relative_l2  # ||a - b|| / ||b|| over all tensors


@dataclass(frozen=True)
class FullBatch:
    """The full-batch gradient of some rows, with what a comparison against it needs (see :func:`full_batch`)."""

    grads: dict[str, torch.Tensor]
    rounding: Rounding
    mistake: float

    def check(self, got: dict[str, torch.Tensor]) -> float:
        """Assert ``got`` (float32, summed in another order) equals :attr:`grads` to float32 rounding."""
        return self.rounding.check(got, self.grads, mistake=self.mistake)


def calibrated(
    gradient: Callable[[torch.nn.Module], dict[str, torch.Tensor]],
    model: torch.nn.Module,
    *,
    mistake: float | Callable[[torch.nn.Module], dict[str, torch.Tensor]],
    what: str = "gradient",
) -> FullBatch:
    """A reference gradient ``gradient(model)`` (on a copy: ``model`` is not changed) in float32, calibrated for
    comparing a gradient summed in another order with it: ``rounding`` from the same ``gradient`` of a float64 copy
    (``tests/helpers/rounding.py``; ``gradient`` must not cast to float32 on the way), and ``mistake``, the size of a
    real error: a relative L2 difference, or a function giving a wrong gradient (a row lost, another normaliser) whose
    difference from the reference is that size."""
    grads = gradient(copy.deepcopy(model))
    grads64 = gradient(copy.deepcopy(model).double())
    if callable(mistake):
        mistake = relative_l2(mistake(copy.deepcopy(model)), grads)
    return FullBatch(grads, Rounding.of(grads, grads64, relative_l2, what=what), mistake)


def full_batch(model: torch.nn.Module, dm: SFTDataModule, rows: list[int]) -> FullBatch:
    """:func:`full_batch_gradient` of ``rows`` (``model`` is not changed), calibrated for comparing an accumulated or
    DDP gradient with it (:func:`calibrated`); as the size of a real mistake the gradient's relative change when the
    last row is left out (a row lost or counted twice at a window or rank boundary)."""
    return calibrated(
        lambda m: full_batch_gradient(m, dm, rows),
        model,
        # one row: leaving it out leaves no gradient at all
        mistake=(lambda m: full_batch_gradient(m, dm, rows[:-1])) if len(rows) > 1 else 1.0,
        what="full-batch gradient",
    )
