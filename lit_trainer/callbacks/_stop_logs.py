"""What :class:`~lit_trainer.callbacks.JITCheckpoint` does to the logs and the logger step when it stops a run:
the saved step's logs are written before the save (each step has one row in every logger), and a checkpoint written
inside a batch (a generation round stopped by a signal) resumes with the right logger step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl


def write_step_logs(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int) -> None:
    """Write the logs of the optimizer step that just ended, which Lightning writes after the callbacks'
    ``on_train_batch_end``: the module's ``on_train_batch_end`` (where a module may log) and the logger connector's
    step metrics, with ``trainer.should_stop`` set meanwhile, as Lightning sets it for a run that stops early, so that
    the step is logged even between two ``log_every_n_steps`` steps (a module's pending window included)."""
    stopping, trainer.should_stop = trainer.should_stop, True
    try:
        pl_module.on_train_batch_end(outputs, batch, idx)
        connector = trainer._logger_connector
        connector.on_batch_end()
        connector.update_train_step_metrics()
    finally:
        trainer.should_stop = stopping


def write_pending_logs(pl_module: pl.LightningModule) -> None:
    """Let a module write what it keeps for a later logging step (``write_pending_logs``, every rank)."""
    write = getattr(pl_module, "write_pending_logs", None)
    if callable(write):
        write()


@contextlib.contextmanager
def logger_step_for_a_save_inside_a_batch(trainer: pl.Trainer) -> Iterator[None]:
    """Save the logger step a checkpoint written inside a batch resumes with.

    Lightning resumes such a checkpoint at its last completed batch, and adds one to the saved logger step
    (``_batches_that_stepped``) when the checkpoint's batch would close an optimizer step, as for a checkpoint saved
    before that step was counted; inside a batch it has already been counted, so one less is saved.
    """
    loop = trainer.fit_loop.epoch_loop
    counted = 0 if loop._should_accumulate() else 1
    loop._batches_that_stepped -= counted
    try:
        yield
    finally:
        loop._batches_that_stepped += counted
