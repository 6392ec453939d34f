"""RewardModule on 2 CPU ranks (gloo), in ONE launch: DDP with accumulation, then FSDP2 (``ModelParallelStrategy``).

Usage: python reward_ranks.py OUT_DIR. Lightning's launcher re-executes this file for rank 1. Each rank writes
``ddp_rank<r>.pt``: the gradient before each optimizer step and the input ids of each micro-batch, of a DDP fit with
learning rate 0 (12 pairs, 2 per micro-batch, accumulate 2: per rank a window of 2 micro-batches, then a short
window of 1). Rank 0 writes ``fsdp.pt``: the full weights after a sharded fit (see
``tests/test_reward_ranks.py``, which runs the one-process references).
"""

import os
import sys

if __name__ == "__main__":
    import _fsdp_common as common
    import lightning.pytorch as pl
    import torch
    from reward_common import datamodule, reward_module

    from helpers.accumulation import GradCapture

    out = sys.argv[1]
    torch.set_num_threads(1)
    capture, seen = GradCapture(), []

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch["input_ids"].clone())

    trainer = common.trainer("ddp", 2, 2, [capture, Recorder()])
    trainer.fit(reward_module(learning_rate=0.0), datamodule=datamodule(12, 2))
    torch.save({"grads": capture.grads, "seen": seen}, os.path.join(out, f"ddp_rank{trainer.global_rank}.pt"))

    module = reward_module(learning_rate=1e-3)
    trainer = common.trainer(common.model_parallel(), 2, common.DPO_STEPS, [])
    trainer.fit(module, datamodule=datamodule(16, 2))
    weights = common.full_weights(module)
    param_type = type(next(module.model.parameters())).__name__
    if trainer.is_global_zero:
        torch.save({"weights": weights, "param_type": param_type}, os.path.join(out, "fsdp.pt"))
