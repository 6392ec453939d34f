"""BEMA on 2 CPU ranks (gloo): per-rank data, evaluate_with_bema on every rank, resume from a rank-0 checkpoint.

Usage: python ddp_bema.py OUT_DIR  (writes OUT_DIR/rank{0,1}.pt; tests/test_bema.py::test_ddp_two_ranks checks them)
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_bema import LinearSGD, coefficients  # tests/ is on PYTHONPATH (helpers.ddp.script_env)

from lit_trainer.callbacks.bema import BEMA

CONFIG = dict(update_freq=2, update_after=1, lag=1, ema_power=0.6, bias_power=0.25)
STEPS = 10


class RankLinearSGD(LinearSGD):
    """Rank r's loss at step t is c_{t + 100 r} . theta; DDP averages the two gradients."""

    def training_step(self, batch, batch_idx):
        c = torch.from_numpy(coefficients(self.trainer.global_step + 100 * self.global_rank))
        return (c * self.theta()).sum()


def trainer(callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
    )


if __name__ == "__main__":
    out = Path(sys.argv[1])
    bema = BEMA(**CONFIG, evaluate_with_bema=True)
    module = RankLinearSGD()
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1)
    first = trainer([bema, ckpt])
    first.fit(module)

    resumed = BEMA(**CONFIG)
    second = trainer([resumed])
    second.fit(RankLinearSGD(), ckpt_path=out / "ckpt" / "step=4.ckpt")

    torch.save(
        {
            "config": CONFIG,
            "steps": STEPS,
            "bema": {k: v.clone() for k, v in bema.bema_state_dict().items()},
            "resumed_bema": {k: v.clone() for k, v in resumed.bema_state_dict().items()},
            "live": {k: v.detach().clone() for k, v in module.named_parameters() if v.requires_grad},
            "val": [(int(s), float(v)) for s, v in module.val_records],
        },
        out / f"rank{first.global_rank}.pt",
    )
    assert np.isfinite([v for _, v in module.val_records]).all()
