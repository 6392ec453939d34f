"""ORPOModule on 2 CPU ranks (gloo) with 2 accumulated micro-batches of 2 pairs per rank: one optimizer step over
the 8 pairs of ``OUT_DIR/rows.json``. Each rank writes ``OUT_DIR/rank<k>.pt`` with the gradient seen before the step
and the chosen rows it trained on; checked by
tests/test_reference_free.py::test_ddp_two_ranks_give_the_full_batch_gradient (the step's pair mean and its NLL token
mean, prompt tokens included, over both ranks).

Usage: python ddp_reference_free.py OUT_DIR
"""

import json
import os
import sys

if __name__ == "__main__":
    import lightning.pytorch as pl
    import torch
    from datasets import Dataset
    from transformers import ByT5Tokenizer

    from helpers.accumulation import GradCapture
    from helpers.models import tiny_llama
    from lit_trainer.data.preference import PreferenceDataModule
    from lit_trainer.modules.reference_free import ORPOModule

    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    with open(os.path.join(out_dir, "rows.json")) as file:
        rows = json.load(file)
    dm = PreferenceDataModule(
        tokenizer=ByT5Tokenizer(),
        dataset=Dataset.from_dict(rows),
        val_size=0,
        batch_size=2,
        max_length=64,
        sampling="sequential",
    )
    seen = []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch["input_ids"][: batch["input_ids"].shape[0] // 2].clone())

    capture = GradCapture()
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=1,
        accumulate_grad_batches=2,
        callbacks=[capture, Recorder()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(ORPOModule(tiny_llama(0), beta=0.25), datamodule=dm)
    torch.save(
        {"grads": capture.grads, "seen": seen, "world": trainer.world_size},
        os.path.join(out_dir, f"rank{trainer.global_rank}.pt"),
    )
