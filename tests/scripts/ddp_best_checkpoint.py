"""2-process DDP (CPU, gloo) run of NEFTune + EvalOnStart + BestCheckpoint; each rank writes what it saw.

Usage: python ddp_best_checkpoint.py OUT_DIR
Writes OUT_DIR/rank{r}.json, rank{r}_weights.pt (final module state_dict), rank{r}_noise.pt (first training noise).
The monitored `val_score` is scripted per rank and logged WITHOUT sync_dist, so the ranks disagree on purpose.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    import helpers.modules
    from lit_trainer.callbacks.checkpointing import BestCheckpoint
    from lit_trainer.callbacks.eval_on_start import EvalOnStart
    from lit_trainer.callbacks.neftune import NEFTune

    out = sys.argv[1]
    # by optimizer step; rank 0: improves (2), worsens (4), improves (6), worsens (8); rank 1 would pick step 4 or 8
    scores = {0: {0: 100.0, 2: 3.0, 4: 4.0, 6: 2.0, 8: 5.0}, 1: {0: 100.0, 2: 1.0, 4: 0.0, 6: 9.0, 8: 0.0}}

    class TinyLM(helpers.modules.TinyLM):
        """Saves the first step's NEFTune noise and logs a scripted, per-rank `val_score`."""

        def training_step(self, batch, batch_idx: int) -> torch.Tensor:
            ids = batch[0]
            if self.global_step == 0:
                noise = (self.embed(ids) - F.embedding(ids, self.embed.weight)).detach()
                torch.save(noise, os.path.join(out, f"rank{self.global_rank}_noise.pt"))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx: int) -> None:
            super().validation_step(batch, batch_idx)
            self.log("val_score", scores[self.global_rank][self.global_step])

    class StartEvalRecorder(Callback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_validation_end(self, trainer, pl_module) -> None:
            if trainer.global_step == 0:
                self.steps.append(trainer.global_step)

    pl.seed_everything(0)
    ids = torch.randint(0, 16, (64, 6), generator=torch.Generator().manual_seed(0))
    recorder = StartEvalRecorder()
    best = BestCheckpoint(
        dirpath=os.path.join(out, "ckpt"),
        filename="{step}",
        monitor="val_score",
        mode="min",
        save_total_limit=1,
        load_best_at_end=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=8,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        callbacks=[NEFTune(noise_alpha=5.0), EvalOnStart(), recorder, best],
    )
    model = TinyLM(lr=0.5, optimizer="sgd", record_noise=True)
    trainer.fit(model, DataLoader(TensorDataset(ids), batch_size=4), DataLoader(TensorDataset(ids), batch_size=8))
    trainer.strategy.barrier()
    rank = trainer.global_rank
    info = {
        "best_model_path": best.best_model_path,
        "best_model_score": float(best.best_model_score),
        "best_k_models": list(best.best_k_models),
        "files": sorted(os.listdir(os.path.join(out, "ckpt"))),
        "start_eval_steps": recorder.steps,
        "hooks_left": len(model.embed._forward_hooks),
        "noise_max": max(model.seen["train"]),
    }
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(weights, os.path.join(out, f"rank{rank}_weights.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
