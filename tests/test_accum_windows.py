"""Token-exact accumulation over the windows Lightning really steps on: limit_train_batches that cuts a window,
GradientAccumulationScheduler, max_steps; the logged train_loss; the pure window rule."""

import copy
import csv

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from helpers.accumulation import TEXTS, GradCapture, accum_datamodule, full_batch
from helpers.models import tiny_llama
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.data.windows import StepWindows
from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.modules.causal_lm import CausalLMModule


def _fit(tokenizer, dm, callbacks=(), logger=False, loader=None, **trainer_kwargs):
    """lr = 0: the weights never move, so every step's reference gradient uses the initial model."""
    model = tiny_llama(seed=1)
    module = CausalLMModule(copy.deepcopy(model), tokenizer=tokenizer, max_grad_norm=None, learning_rate=0.0)
    capture = GradCapture()
    trainer = pl.Trainer(
        callbacks=[capture, *callbacks],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"limit_val_batches": 0, "num_sanity_val_steps": 0, **trainer_kwargs},
    )
    trainer.fit(module, **({"train_dataloaders": loader} if loader is not None else {"datamodule": dm}))
    return model, capture.grads


def _check_steps(model, dm, grads, step_rows):
    assert len(grads) == len(step_rows)
    for grad, rows in zip(grads, step_rows):
        full_batch(model, dm, rows).check(grad)  # to float32 rounding, calibrated (helpers/rounding.py)


def test_window_rule():
    assert StepWindows(4, 2).bounds(1) == (0, 2)  # limit_train_batches=2 cuts the only window
    assert [StepWindows(4, 6).bounds(i) for i in (0, 3, 4, 5)] == [(0, 4), (0, 4), (4, 6), (4, 6)]
    assert StepWindows(3).bounds(4) == (3, 6)  # unknown length: the loader's end closes the window
    assert StepWindows(2, 4).length(3) == 2 and StepWindows(3, 4).length(3) == 1
    assert StepWindows(4, 2).bounds(2) == (0, 2)  # past the limit: nothing more to fetch
    with pytest.raises(ValueError, match="accumulate_grad_batches=0"):
        StepWindows(0, 4)


def test_limit_train_batches_below_accumulate_is_exact_and_logs_the_full_batch_loss(tokenizer, tmp_path):
    # 4 micro-batches of 2 uneven rows; accumulate 4 but only 2 micro-batches per epoch: one short window
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    logger = pl.loggers.CSVLogger(tmp_path, name="logs", version=0)
    model, grads = _fit(
        tokenizer, dm, logger=logger, max_steps=1, accumulate_grad_batches=4, limit_train_batches=2, log_every_n_steps=1
    )
    _check_steps(model, dm, grads, [[0, 1, 2, 3]])
    batch = dm._collate([dm.train_dataset[i] for i in range(4)], True)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = float(causal_lm_loss(logits, batch["labels"]))
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    assert len(rows) == 1
    assert float(rows[0]["train_loss"]) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("limit", [6, 0.75])
def test_limit_train_batches_with_a_full_then_a_short_window(tokenizer, limit):
    # 8 micro-batches of one row; limit 6 (or 0.75 x 8): windows [0, 4) and [4, 6)
    dm = accum_datamodule(tokenizer, batch_size=1)
    dm.setup("fit")
    model, grads = _fit(tokenizer, dm, max_epochs=1, accumulate_grad_batches=4, limit_train_batches=limit)
    _check_steps(model, dm, grads, [[0, 1, 2, 3], [4, 5]])


def test_gradient_accumulation_scheduler_is_exact(tokenizer):
    # epoch 0: accumulate 1 (4 steps of 2 rows); epoch 1: accumulate 2 (2 steps of 4 rows)
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    model, grads = _fit(tokenizer, dm, [GradientAccumulationScheduler({0: 1, 1: 2})], max_epochs=2)
    _check_steps(model, dm, grads, [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1, 2, 3], [4, 5, 6, 7]])


def test_max_steps_stopping_mid_epoch_is_exact(tokenizer):
    # 8 micro-batches of one row, accumulate 3: max_steps=2 stops after micro-batch 5, mid-epoch
    dm = accum_datamodule(tokenizer, batch_size=1)
    dm.setup("fit")
    model, grads = _fit(tokenizer, dm, max_steps=2, accumulate_grad_batches=3)
    _check_steps(model, dm, grads, [[0, 1, 2], [3, 4, 5]])


def test_a_train_loader_passed_to_fit_follows_the_trainer_windows(tokenizer):
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    loader = dm.train_dataloader()  # built outside a Trainer: no window source until the module binds it
    assert loader.windows is None
    model, grads = _fit(tokenizer, dm, loader=loader, max_steps=1, accumulate_grad_batches=4, limit_train_batches=2)
    _check_steps(model, dm, grads, [[0, 1, 2, 3]])


def test_validation_inside_a_window_leaves_the_step_exact(tokenizer):
    # val_check_interval counts micro-batches: validation runs after micro-batch 1, inside the 4-micro-batch window
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    with_val = SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS}),
        validation_dataset=Dataset.from_dict({"text": TEXTS[:3]}),
        batch_size=2,
        max_length=64,
        sampling="sequential",
    )
    validations = []

    class Spy(pl.Callback):
        def on_validation_start(self, trainer, pl_module):
            validations.append(trainer.global_step)

    model, grads = _fit(
        tokenizer,
        with_val,
        [Spy()],
        max_steps=1,
        accumulate_grad_batches=4,
        val_check_interval=2,
        limit_val_batches=None,
        check_val_every_n_epoch=None,
    )
    assert validations[:1] == [0]  # before the first optimizer step, i.e. inside its window
    _check_steps(model, dm, grads, [[0, 1, 2, 3, 4, 5, 6, 7]])
