"""Training with a CSV logger and reading back the rows that logged ``train_loss``."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger


def fit_train_loss_rows(
    module: pl.LightningModule, dm: pl.LightningDataModule, logdir: Path, max_steps: int, every: int
) -> list[dict[str, str]]:
    """Fit ``module`` for ``max_steps`` steps, logging every ``every`` steps to a CSV logger under ``logdir`` (no
    validation, checkpoints, progress bar or summary); the ``metrics.csv`` rows that hold a ``train_loss``."""
    trainer = pl.Trainer(
        max_steps=max_steps,
        log_every_n_steps=every,
        logger=CSVLogger(logdir, name="r"),
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    with open(Path(logdir) / "r" / "version_0" / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row["train_loss"]]
