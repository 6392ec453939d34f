"""Fault-injection training runs for tests/test_exact_resume.py (one process per run, CPU).

A tiny LM (embedding -> dropout -> linear; or ``--model llama``: the ~0.5M-parameter Llama, hidden 128, 2 layers,
vocab 384, attention dropout 0.1) trains 2 epochs on a shuffled ``TrainLoader`` (24 samples, micro-batch 2,
``accumulate_grad_batches=2``: 12 micro-batches and 6 optimizer steps per epoch) with NEFTune, an EMA of the
weights (``EMAWeightAveraging``), AdamW with a per-step LR schedule, and a validation every 3 micro-batches on a
plain ``DataLoader`` (which draws a seed from the global RNG each time it is iterated). Callbacks: ``ExactResume``
and ``JITCheckpoint(kill_wait=0)``, the latter listed before the EMA so that it has to move itself behind it.

One run::

    python fault_injection_train.py OUT --ckpt-dir DIR [--resume never|auto|PATH] [--pause SPEC] [--slow-save]
        [--model tiny|llama]

A plan of runs (what the test uses)::

    python fault_injection_train.py OUT --plan plan.json      # [{"name", "ckpt_dir", "resume", "pause", ...}]

In plan mode the libraries are imported once and every run is a forked child process (``os.fork``, before any
computation), which exits with the run's own status; ``OUT/<name>/status.json`` then records ``returncode`` (negative
for a signal, as ``subprocess`` reports it) and the time the child ended. A fresh interpreter per run would cost an
import of Lightning each (about 10 s of CPU here).

``--pause train:EPOCH:BATCH`` (at ``on_train_batch_start``) or ``val:EPOCH:AFTER_TRAIN_BATCH:VAL_BATCH`` (at
``on_validation_batch_start``) writes ``OUT/<name>/ready.json`` with the pid and waits until the JITCheckpoint handler
has recorded a signal, so the test can send a real SIGTERM at an exact point. ``--slow-save`` installs a CheckpointIO
that writes half the file, writes ``saving.json`` and hangs (the test then SIGKILLs). Every run writes
``result.json``; a finished run also writes ``final.pt`` (the weights).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader

from helpers.modules import TinyHF, TinyLM
from lit_trainer.callbacks import ExactResume, resolve_resume
from lit_trainer.callbacks.jit_checkpoint import JITCheckpoint, JITCheckpointExit
from lit_trainer.callbacks.neftune import NEFTune
from lit_trainer.data.loader import TrainLoader
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler

N_TRAIN, N_VAL, TOTAL_STEPS = 24, 4, 12


class _Schedule:
    """AdamW with a per-step linearly decaying learning rate."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (TOTAL_STEPS + 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TinyScheduled(_Schedule, TinyLM):
    pass


class LlamaScheduled(_Schedule, TinyHF):
    pass


def build_module(kind: str) -> L.LightningModule:
    if kind == "llama":
        return LlamaScheduled(seed=None, hidden=128, layers=2, heads=4, intermediate=512, dropout=0.1)
    return TinyScheduled(vocab=64, dim=16, dropout=0.1)


class Pause(Callback):
    """Waits at one point until the JITCheckpoint handler saw a signal sent by the test."""

    def __init__(self, spec: str | None, jit: JITCheckpoint, out: Path) -> None:
        self.spec = tuple(spec.split(":")) if spec else None
        self.jit, self.out, self.last_train_batch = jit, out, -1

    def _wait(self) -> None:
        (self.out / "ready.json").write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
        deadline = time.monotonic() + 60
        while not self.jit.requested:
            if time.monotonic() > deadline:
                raise RuntimeError("no signal arrived within 60 s")
            time.sleep(0.002)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.spec == ("train", str(trainer.current_epoch), str(batch_idx)):
            self._wait()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last_train_batch = batch_idx

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        here = ("val", str(trainer.current_epoch), str(self.last_train_batch), str(batch_idx))
        if not trainer.sanity_checking and self.spec == here:
            self._wait()


class Recorder(Callback):
    """Records (kind, epoch, batch, global_step) after each training batch and each validation run."""

    def __init__(self) -> None:
        self.events: list[list[Any]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.events.append(["train", trainer.current_epoch, batch_idx, trainer.global_step])

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.events.append(["val", trainer.current_epoch, -1, trainer.global_step])


class SlowIO(TorchCheckpointIO):
    """Writes half of the checkpoint, announces it, and hangs (a save on a very slow file system)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        (self.out / "saving.json").write_text(json.dumps({"pid": os.getpid(), "path": str(path)}))
        time.sleep(120)


def build_data(kind: str) -> tuple[TrainLoader, DataLoader]:
    vocab, seq = (384, 32) if kind == "llama" else (64, 9)
    gen = torch.Generator().manual_seed(1234)
    rows = [{"input_ids": torch.randint(3, vocab, (seq,), generator=gen)} for _ in range(N_TRAIN + N_VAL)]

    def collate(batch: list[dict]) -> dict:
        return {"input_ids": torch.stack([r["input_ids"] for r in batch])}

    train = TrainLoader(
        rows[:N_TRAIN], ShardedBatchSampler(N_TRAIN, 2, seed=1), collate, accumulate_grad_batches=2, seed=1
    )
    return train, DataLoader(rows[N_TRAIN:], batch_size=2, collate_fn=collate)


def run(spec: dict[str, Any], out: Path) -> None:
    """One training run; raises JITCheckpointExit when stopped by a signal."""
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    kind = spec.get("model", "tiny")
    train, val = build_data(kind)
    jit = JITCheckpoint(kill_wait=0.0, dirpath=spec["ckpt_dir"])
    recorder = Recorder()
    callbacks = [
        Pause(spec.get("pause"), jit, out),
        jit,
        NEFTune(noise_alpha=5.0),
        EMAWeightAveraging(decay=0.9),
        recorder,
        ExactResume(),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=2,
        val_check_interval=3,
        callbacks=callbacks,
        plugins=[SlowIO(out)] if spec.get("slow_save") else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=str(out),
    )
    module = build_module(kind)
    ckpt_path = resolve_resume(spec.get("resume", "never"), spec["ckpt_dir"], trainer)
    result: dict[str, Any] = {
        "resumed_from": ckpt_path,
        "pid": os.getpid(),
        "order": [type(cb).__name__ for cb in trainer.callbacks],
    }
    try:
        trainer.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    except JITCheckpointExit as stop:
        result.update(
            exit=stop.code,
            checkpoint=stop.checkpoint_path,
            step=trainer.global_step,
            save_seconds=jit.save_seconds,
            events=recorder.events,
            order=[type(cb).__name__ for cb in trainer.callbacks],
        )
        (out / "result.json").write_text(json.dumps(result))
        raise
    torch.save(module.state_dict(), out / "final.pt")
    result.update(exit=0, step=trainer.global_step, events=recorder.events)
    (out / "result.json").write_text(json.dumps(result))


def _child(spec: dict[str, Any], out: Path) -> None:
    """Body of a forked run: never returns; the status is the run's own exit status."""
    code = 0
    try:
        run(spec, out)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_plan(plan: list[dict[str, Any]], out: Path) -> None:
    for spec in plan:
        run_out = out / spec["name"]
        run_out.mkdir(parents=True, exist_ok=True)
        pid = os.fork()
        if pid == 0:
            _child(spec, run_out)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)  # negative: killed by that signal
        (run_out / "status.json").write_text(json.dumps({"pid": pid, "returncode": code, "end": time.time()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--plan", default=None)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", default="never")
    parser.add_argument("--pause", default=None)
    parser.add_argument("--slow-save", action="store_true")
    parser.add_argument("--model", choices=("tiny", "llama"), default="tiny")
    args = parser.parse_args()
    out = Path(args.out)
    if args.plan:
        run_plan(json.loads(Path(args.plan).read_text()), out)
        return
    if args.ckpt_dir is None:
        parser.error("--ckpt-dir is required without --plan")
    spec = {
        "ckpt_dir": args.ckpt_dir,
        "resume": args.resume,
        "pause": args.pause,
        "slow_save": args.slow_save,
        "model": args.model,
    }
    run(spec, out)


if __name__ == "__main__":
    main()
