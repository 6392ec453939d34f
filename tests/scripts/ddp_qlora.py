"""QLoRA (a 4-bit NF4 base with LoRA adapters and 8-bit AdamW) under DDP on 2 CPU ranks (gloo).

Usage: python ddp_qlora.py OUT_DIR. Lightning's launcher re-executes this file for rank 1. Trains
``qlora_common.STEPS`` optimizer steps with 2 rows per rank, then writes ``rank{r}.pt`` from each rank: the adapter
weights and a checksum of the packed 4-bit base. Checked by ``tests/test_qlora.py`` against one process training on
the same 4 rows per step.
"""

import os
import sys

if __name__ == "__main__":
    import qlora_common
    import torch

    out = sys.argv[1]
    torch.set_num_threads(1)
    module = qlora_common.module()
    trainer = qlora_common.trainer(devices=2, strategy="ddp", accumulate=1)
    trainer.fit(module, datamodule=qlora_common.datamodule(batch_size=2))
    torch.save(
        {"adapter": qlora_common.adapter(module), "base": qlora_common.base_checksum(module)},
        os.path.join(out, f"rank{trainer.global_rank}.pt"),
    )
