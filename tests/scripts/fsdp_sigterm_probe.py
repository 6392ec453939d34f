"""A callback for ``tests/test_fsdp_resume.py``: on global rank 1 only, SIGTERM itself once the optimizer step named
by the environment variable ``FSDP_TEST_SIGTERM_STEP`` is done, unless the fit started from a checkpoint (so a rerun
of the same command line, which resumes, runs to the end); records each rank's final full weights and the node it ran
on (torchrun's ``GROUP_RANK``). With ``FSDP_TEST_SIGTERM_TARGET=launcher`` the signal goes to the process that started
rank 1 (its node's torchrun agent, which forwards it to its worker) instead: a node being preempted."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch

from lit_trainer.core import sharding as _sharding


class SigtermOneRank(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self._sent = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        for callback in trainer.callbacks:  # act at the next step boundary: the default grace outlasts this short run
            if hasattr(callback, "kill_wait"):
                callback.kill_wait = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        step = os.environ.get("FSDP_TEST_SIGTERM_STEP")
        due = trainer.ckpt_path is None and trainer.global_rank == 1 and str(trainer.global_step) == step
        if due and not self._sent:
            self._sent = True  # once: the step's other micro-batches end at the same global step
            launcher = os.environ.get("FSDP_TEST_SIGTERM_TARGET") == "launcher"
            os.kill(os.getppid() if launcher else os.getpid(), signal.SIGTERM)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        weights = {n: _sharding.full(p.detach()).clone() for n, p in pl_module.model.named_parameters()}
        resumed = trainer.ckpt_path is not None
        torch.save(
            {
                "weights": weights,
                "step": trainer.global_step,
                "resumed": resumed,
                "node": os.environ.get("GROUP_RANK"),
                "world_size": trainer.world_size,
            },
            os.path.join(self.out, f"final_{'resumed' if resumed else 'fresh'}_rank{trainer.global_rank}.pt"),
        )

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        """Record the status this rank is about to exit with (``JITCheckpointExit`` is a ``SystemExit``): under
        torchrun a node whose launcher was signalled does not report its worker's status."""
        code = exception.code if isinstance(exception, SystemExit) else repr(exception)
        with open(os.path.join(self.out, f"exit_rank{trainer.global_rank}.json"), "w") as file:
            json.dump({"code": code, "node": os.environ.get("GROUP_RANK")}, file)
