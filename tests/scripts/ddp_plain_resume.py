"""A real 2-process DDP run on CPU (gloo) of a plain LightningModule + plain shuffled DataLoader + dropout, with
ExactResume: the uninterrupted run, then resumes from a checkpoint inside an accumulation window, mid-epoch at a step
boundary, and at the epoch boundary.

Run by ``tests/test_exact_resume_ddp.py`` as ``python ddp_plain_resume.py OUT_DIR``. Lightning's subprocess launcher
re-executes this file for rank 1, so everything runs under ``if __name__ == "__main__"``.

Geometry: 32 rows, batch 2, Lightning's DistributedSampler gives each rank 16 rows = 8 micro-batches an epoch;
accumulate 2 -> 4 optimizer steps an epoch, 2 epochs. Each rank seeds its generators with its rank, so the per-rank
RNG states matter. Outputs per phase and rank: ``{phase}_rank{r}.pt`` with the final weights and the trained targets.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

ROWS, BATCH, ACCUMULATE, EPOCHS = 32, 2, 2, 2
PHASES = {"mid_window": "mid_window.ckpt", "mid_epoch": "ck/epoch=0-step=2.ckpt", "epoch_end": "ck/epoch=0-step=4.ckpt"}

if __name__ == "__main__":
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from helpers.modules import DropoutRegressor
    from lit_trainer.callbacks import ExactResume

    out_dir = sys.argv[1]

    class Seen(pl.Callback):
        def __init__(self, save_mid_window: bool) -> None:
            self.targets: list[list[float]] = []
            self.save_mid_window = save_mid_window

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.targets.append(batch[1].tolist())

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if self.save_mid_window and len(self.targets) == 3:  # step 1's window holds micro-batches 2 and 3
                trainer.save_checkpoint(os.path.join(out_dir, "mid_window.ckpt"))  # on every rank

    def run(phase: str, ckpt: str | None) -> None:
        g = torch.Generator().manual_seed(1)
        data = list(zip(torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, generator=g), strict=True))
        seen = Seen(save_mid_window=phase == "full")
        callbacks: list[pl.Callback] = [ExactResume(), seen]
        if phase == "full":
            callbacks.append(ModelCheckpoint(dirpath=os.path.join(out_dir, "ck"), every_n_train_steps=1, save_top_k=-1))
        trainer = pl.Trainer(
            accelerator="cpu",
            strategy="ddp",
            devices=2,
            max_epochs=EPOCHS,
            accumulate_grad_batches=ACCUMULATE,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=phase == "full",
            callbacks=callbacks,
            default_root_dir=out_dir,
        )
        pl.seed_everything(trainer.global_rank)
        module = DropoutRegressor()
        trainer.fit(
            module,
            DataLoader(data, batch_size=BATCH, shuffle=True),
            ckpt_path=os.path.join(out_dir, ckpt) if ckpt else None,
        )
        torch.save(
            {"weights": module.state_dict(), "targets": seen.targets, "step": trainer.global_step},
            os.path.join(out_dir, f"{phase}_rank{trainer.global_rank}.pt"),
        )

    run("full", None)
    for name, path in PHASES.items():
        run(name, path)
