"""2-process DDP (gloo): the step gradient with accumulation equals the full-batch token-mean gradient.

Usage: python ddp_grad_accum.py OUT_DIR [LIMIT_TRAIN_BATCHES or -] [PACKING] [SAMPLING]. Each rank writes
rank<k>.pt with its captured gradient and rows seen.
"""

import copy
import os
import sys

if __name__ == "__main__":
    import lightning.pytorch as pl
    import torch
    from transformers import ByT5Tokenizer

    from helpers.accumulation import GradCapture, accum_datamodule
    from helpers.models import tiny_llama
    from lit_trainer.modules.causal_lm import CausalLMModule

    out_dir = sys.argv[1]
    limit = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    packing = sys.argv[3] if len(sys.argv) > 3 else "none"
    sampling = sys.argv[4] if len(sys.argv) > 4 else "sequential"
    torch.set_num_threads(1)
    tokenizer = ByT5Tokenizer()
    model = tiny_llama(seed=1)
    initial = copy.deepcopy(model.state_dict())
    module = CausalLMModule(model, tokenizer=tokenizer, max_grad_norm=None, learning_rate=0.0)
    capture = GradCapture()
    seen = []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch["input_ids"].clone())

    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=1,
        accumulate_grad_batches=2,
        callbacks=[capture, Recorder()],
        enable_checkpointing=False,
        log_every_n_steps=1,
        logger=pl.loggers.CSVLogger(out_dir, name="logs", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        limit_train_batches=limit,
    )
    trainer.fit(module, datamodule=accum_datamodule(tokenizer, batch_size=2, packing=packing, sampling=sampling))
    torch.save(
        {"grads": capture.grads, "seen": seen, "initial": initial, "world": trainer.world_size},
        os.path.join(out_dir, f"rank{trainer.global_rank}.pt"),
    )
