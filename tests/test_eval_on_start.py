"""EvalOnStart callback: step-0 metrics equal trainer.validate, no side effects, errors, resume, CLI."""

from __future__ import annotations

import copy
import csv
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from helpers.cli import cli_with_callback
from helpers.data import regression_data as _data
from helpers.modules import Regressor
from lit_trainer.callbacks.eval_on_start import EvalOnStart, check_lightning_internals


class NoValidation(Regressor):
    validation_step = pl.LightningModule.validation_step


class StateAtFirstBatch(Callback):
    """Records what other callbacks hold when the first training batch of this fit starts."""

    def __init__(self) -> None:
        self.seen: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen is None:
            es = next(c for c in trainer.callbacks if isinstance(c, EarlyStopping))
            mc = next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint))
            self.seen = {
                "wait_count": es.wait_count,
                "best_score": es.best_score.item(),
                "ckpts": sorted(os.listdir(mc.dirpath)) if os.path.isdir(mc.dirpath) else [],
                "callback_metrics": sorted(trainer.callback_metrics),
            }


def _trainer(tmp_path: Path, callbacks: list, max_steps: int = 4, logger=None) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _val_rows(log_dir: str) -> dict[int, float]:
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return {int(r["step"]): float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")}


def _side_effect_callbacks(tmp_path: Path) -> tuple[StateAtFirstBatch, list[Callback]]:
    probe = StateAtFirstBatch()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=-1, filename="{step}")
    return probe, [EvalOnStart(), EarlyStopping("val_loss", patience=1), ckpt, probe]


def test_step0_metric_equals_validate_and_has_no_side_effects(tmp_path: Path) -> None:
    pl.seed_everything(0)
    model = Regressor()
    untrained = copy.deepcopy(model)
    expected = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False).validate(
        untrained, DataLoader(_data(1), batch_size=8), verbose=False
    )[0]["val_loss"]
    probe, callbacks = _side_effect_callbacks(tmp_path)
    trainer = _trainer(tmp_path, callbacks, logger=CSVLogger(tmp_path, name="csv"))
    trainer.fit(model, DataLoader(_data(0), batch_size=8), DataLoader(_data(1), batch_size=8))
    rows = _val_rows(trainer.logger.log_dir)
    # validations after 2 and 4 optimizer steps are logged at steps 1 and 3 (0-based logger step)
    assert sorted(rows) == [0, 1, 3]
    assert rows[0] == pytest.approx(expected, rel=1e-6)
    assert rows[0] != rows[3]
    # EarlyStopping untouched (initial wait 0, best +inf), no checkpoint, step-0 metrics not left for callbacks
    assert probe.seen == {"wait_count": 0, "best_score": math.inf, "ckpts": [], "callback_metrics": []}
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step=2.ckpt", "step=4.ckpt"]


def _final_weights(with_eval: bool, tmp_path: Path) -> list[torch.Tensor]:
    pl.seed_everything(3)
    model = Regressor()
    callbacks = [EvalOnStart()] if with_eval else []
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(_data(0), batch_size=8, shuffle=True), DataLoader(_data(1), batch_size=8))
    return [p.detach().clone() for p in model.parameters()]


def test_training_is_unchanged_by_the_start_evaluation(tmp_path: Path) -> None:
    # the validation dataloader's iterator draws a seed from the global RNG; isolate_rng keeps the shuffle identical
    for a, b in zip(_final_weights(True, tmp_path), _final_weights(False, tmp_path)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["no_validation_step", "no_val_dataloader", "limit_zero"])
def test_clear_error_without_validation_data(tmp_path: Path, case: str) -> None:
    model = NoValidation() if case == "no_validation_step" else Regressor()
    val = None if case == "no_val_dataloader" else DataLoader(_data(1), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        callbacks=[EvalOnStart()],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0 if case == "limit_zero" else None,
        default_root_dir=tmp_path,
    )
    message = {
        "no_validation_step": "defines no `validation_step`",
        "no_val_dataloader": "gives no validation batches",
        "limit_zero": "limit_val_batches=0",
    }[case]
    with pytest.raises(RuntimeError, match=message):
        trainer.fit(model, DataLoader(_data(0), batch_size=8), val)


def _resumed_val_rows(tmp_path: Path, resume_from: Path, on_resume: bool) -> dict[int, float]:
    probe, callbacks = _side_effect_callbacks(tmp_path / f"run_{on_resume}")
    callbacks[0] = EvalOnStart(on_resume=on_resume)
    trainer = _trainer(tmp_path, callbacks, max_steps=4, logger=CSVLogger(tmp_path, name=f"resumed_{on_resume}"))
    trainer.fit(
        Regressor(), DataLoader(_data(0), batch_size=8), DataLoader(_data(1), batch_size=8), ckpt_path=resume_from
    )
    # the resumed ModelCheckpoint (last saved step 0 != 2) would save here without EvalOnStart's guard
    assert probe.seen == {"wait_count": 0, "best_score": math.inf, "ckpts": [], "callback_metrics": []}
    return _val_rows(trainer.logger.log_dir)


def test_resume_runs_again_only_if_asked_and_leaves_the_resumed_run_unchanged(tmp_path: Path) -> None:
    pl.seed_everything(0)
    model = Regressor()
    first = _trainer(tmp_path, [], max_steps=2)
    first.fit(model, DataLoader(_data(0), batch_size=8), DataLoader(_data(1), batch_size=8))
    resume_from = tmp_path / "resume.ckpt"
    first.save_checkpoint(resume_from)
    expected = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False).validate(
        copy.deepcopy(model), DataLoader(_data(1), batch_size=8), verbose=False
    )[0]["val_loss"]
    plain = _resumed_val_rows(tmp_path, resume_from, on_resume=False)
    again = _resumed_val_rows(tmp_path, resume_from, on_resume=True)
    # without on_resume: only the validation inside training (after step 4); with it, the start evaluation comes
    # first, at the resumed step 2, and equals trainer.validate on the restored weights
    assert len(plain) == 1 and min(plain) > 2
    assert sorted(again) == [2, *plain] and again[2] == pytest.approx(expected, rel=1e-6)
    # the training and in-training validation after the extra pass are unchanged
    assert again[min(plain)] == plain[min(plain)]


def test_lightning_internals_are_present() -> None:
    check_lightning_internals(pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False))

    class Bare:
        pass

    with pytest.raises(RuntimeError, match="pin that version"):
        check_lightning_internals(Bare())  # type: ignore[arg-type]


def test_configurable_from_lightning_cli() -> None:
    cli = cli_with_callback(Regressor, "lit_trainer.callbacks.eval_on_start.EvalOnStart", {"on_resume": True})
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, EvalOnStart)]
    assert cb.on_resume is True
