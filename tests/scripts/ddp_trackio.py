"""A real 2-process DDP run on CPU (gloo) with TrackioLogger: every rank logs ``train_loss`` each step and a table at
steps 2 and 4 (as GRPO's completions are logged: ``log_table`` on every logger that has it), and only rank 0 writes.

Run by ``tests/test_trackio_ddp.py`` as ``python ddp_trackio.py OUT_DIR PROJECT``; trackio's store is
``TRACKIO_DIR`` from the environment. Lightning's launcher re-executes this file for rank 1, so everything runs under
``if __name__ == "__main__"``.
"""

from __future__ import annotations

import sys

STEPS = 5

if __name__ == "__main__":
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from helpers.data import regression_data
    from lit_trainer.loggers import TrackioLogger

    out_dir, project = sys.argv[1], sys.argv[2]

    class Logged(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if self.trainer.global_step in (2, 4):
                for logger in self.trainer.loggers:
                    if hasattr(logger, "log_table"):
                        rows = [[self.global_rank, self.trainer.global_step]]
                        logger.log_table(key="samples", columns=["rank", "step"], data=rows, step=self.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=TrackioLogger(project=project, save_dir=out_dir, name="ddp", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Logged(), DataLoader(regression_data(0, n=64), batch_size=4))
