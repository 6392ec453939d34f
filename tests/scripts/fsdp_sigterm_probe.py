"""A callback for ``tests/test_fsdp_resume.py``: on global rank 1 only, SIGTERM itself once the optimizer step named
by the environment variable ``FSDP_TEST_SIGTERM_STEP`` is done, unless the fit started from a checkpoint (so a rerun
of the same command line, which resumes, runs to the end); records each rank's final full weights."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch

from lit_trainer.modules.base import _sharding


class SigtermOneRank(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        for callback in trainer.callbacks:  # act at the next step boundary: the default grace outlasts this short run
            if hasattr(callback, "kill_wait"):
                callback.kill_wait = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        step = os.environ.get("FSDP_TEST_SIGTERM_STEP")
        if trainer.ckpt_path is None and trainer.global_rank == 1 and str(trainer.global_step) == step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        weights = {n: _sharding.full(p.detach()).clone() for n, p in pl_module.model.named_parameters()}
        resumed = trainer.ckpt_path is not None
        torch.save(
            {"weights": weights, "step": trainer.global_step, "resumed": resumed},
            os.path.join(self.out, f"final_{'resumed' if resumed else 'fresh'}_rank{trainer.global_rank}.pt"),
        )
