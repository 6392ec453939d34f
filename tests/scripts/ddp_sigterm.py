"""Real 2-process DDP (CPU, gloo) SIGTERM runs for tests/test_jit_checkpoint.py.

Tiny LM (embedding -> dropout -> linear) with NEFTune, 32 samples, micro-batch 2 per rank,
``accumulate_grad_batches=2``: 8 micro-batches and 4 optimizer steps per epoch, 2 epochs. Each rank seeds its
generators with ``100 + rank``, so the ranks draw different dropout masks and a resume that restored one rank's RNG
state on both would not be exact.

    python ddp_sigterm.py OUT

Phase 1: fit "ref" uninterrupted; fit "b": rank 1 pauses at (epoch 0, batch 4) until signalled;
``JITCheckpoint(exit_code=143)``, so both rank processes exit with 143. Phase 2: fit "c" resumes "b"; both ranks
pause at (epoch 1, batch 2) until signalled; ``exit_code=None``, so fit returns; fit "d" resumes "c" to the end.
Rank 0 of each phase is a child forked from this (already imported) process, so only rank 1 pays for a fresh
interpreter; Lightning launches it by re-running this script, and the phase travels in an environment variable.
``OUT/phaseN_status.json`` holds the exit status of phase N's rank 0 (negative: killed by that signal).

Files per fit F and rank R: ``F_pid_rankR.json`` (at train start), ``F_paused_rankR.json`` (waiting for a signal),
``F_stop_rankR.json`` (how the fit ended: exception, exit code, global step), ``F_final_rankR.pt`` (weights after a
completed fit). Checkpoints go to ``OUT/ckpt_F``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from helpers.modules import TinyLM
from lit_trainer.callbacks import ExactResume, resolve_resume
from lit_trainer.callbacks.jit_checkpoint import JITCheckpoint
from lit_trainer.callbacks.neftune import NEFTune
from lit_trainer.data.loader import TrainLoader
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler

RANK = int(os.environ.get("LOCAL_RANK", "0"))
_PHASE_ENV = "DDP_SIGTERM_PHASE"


class Probe(Callback):
    """Writes the pid, pauses at one (epoch, batch) until JITCheckpoint saw a signal, records how the fit ended."""

    def __init__(self, name: str, out: Path, jit: JITCheckpoint, pause: tuple[int, int] | None) -> None:
        self.name, self.out, self.jit, self.pause = name, out, jit, pause

    def _write(self, what: str, data: dict) -> None:
        (self.out / f"{self.name}_{what}_rank{RANK}.json").write_text(json.dumps(data))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._write("pid", {"pid": os.getpid()})

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.pause != (trainer.current_epoch, batch_idx):
            return
        self._write("paused", {"pid": os.getpid(), "time": time.time()})
        deadline = time.monotonic() + 90
        while not self.jit.requested:
            if time.monotonic() > deadline:
                raise RuntimeError("no signal arrived within 90 s")
            time.sleep(0.002)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._write(
            "stop",
            {
                "exception": type(exception).__name__,
                "code": getattr(exception, "code", None),
                "step": trainer.global_step,
                "checkpoint": self.jit.checkpoint_path,
                "time": time.time(),
            },
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._write(
            "stop",
            {
                "exception": None,
                "step": trainer.global_step,
                "checkpoint": self.jit.checkpoint_path,
                "should_stop": trainer.should_stop,
            },
        )


def data() -> tuple[TrainLoader, DataLoader]:
    gen = torch.Generator().manual_seed(1234)
    rows = [{"input_ids": torch.randint(3, 64, (9,), generator=gen)} for _ in range(40)]

    def collate(batch: list[dict]) -> dict:
        return {"input_ids": torch.stack([r["input_ids"] for r in batch])}

    sampler = ShardedBatchSampler(32, 2, seed=3, num_replicas=2, rank=RANK)
    train = TrainLoader(rows[:32], sampler, collate, accumulate_grad_batches=2, seed=3)
    return train, DataLoader(rows[32:], batch_size=2, collate_fn=collate)


def fit(out: Path, name: str, resume: str, pause: tuple[int, int] | None, exit_code: int | None) -> None:
    L.seed_everything(100 + RANK, verbose=False)
    torch.set_num_threads(1)
    jit = JITCheckpoint(kill_wait=0.0, dirpath=out / f"ckpt_{name}", exit_code=exit_code)
    # an explicit NEFTune seed: with seed=None it takes torch.initial_seed(), which differs per rank here (100 + rank)
    # while only rank 0's is checkpointed (reported to the NEFTune owner)
    callbacks = [ExactResume(), NEFTune(noise_alpha=5.0, seed=7), Probe(name, out, jit, pause), jit]
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_epochs=2,
        accumulate_grad_batches=2,
        val_check_interval=4,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    module = TinyLM(vocab=64, dim=16, dropout=0.2, lr=1e-2, optimizer="adamw")
    train, val = data()
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=resume_path(out, resume))
    if trainer.state.status == "finished" and not trainer.should_stop:
        torch.save(module.state_dict(), out / f"{name}_final_rank{RANK}.pt")


def resume_path(out: Path, resume: str) -> str | None:
    return None if resume == "never" else resolve_resume("auto", out / f"ckpt_{resume}")


def run_phase(out: Path, phase: int) -> None:
    if phase == 1:
        fit(out, "ref", "never", None, 143)
        fit(out, "b", "never", (0, 4) if RANK == 1 else None, 143)
    else:
        fit(out, "c", "b", (1, 2), None)
        fit(out, "d", "c", None, 143)


def _exit_status(phase: int, out: Path) -> int:
    try:
        run_phase(out, phase)
    except SystemExit as stop:  # JITCheckpointExit: the status a scheduler would see
        return stop.code if isinstance(stop.code, int) else 0
    except BaseException:  # never fall through into the parent's loop from a forked child
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if _PHASE_ENV in os.environ:  # rank 1, launched by Lightning (it re-runs this script) inside a phase
        _leave(_exit_status(int(os.environ[_PHASE_ENV]), out))
    for phase in (1, 2):
        pid = os.fork()
        if pid == 0:  # rank 0 of this phase; it launches rank 1 with this environment
            os.environ[_PHASE_ENV] = str(phase)
            _leave(_exit_status(phase, out))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        (out / f"phase{phase}_status.json").write_text(json.dumps({"returncode": code, "end": time.time()}))


def _leave(status: int) -> None:
    """Exit through os._exit: the interpreter teardown of a DDP process (gloo, TCPStore) takes seconds here and
    tests nothing of ours; every file is written and closed before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
