"""KTOModule on 2 CPU ranks (gloo): one optimizer step of 2 rows per rank; each rank saves the batch it trained on and
the gradient of the step (after DDP's all-reduce, before clipping).

Usage: python ddp_kto.py OUT_DIR  (writes OUT_DIR/rank{0,1}.pt, checked by
tests/test_kto.py::test_ddp_two_ranks_share_the_kl_estimate_and_give_the_full_batch_gradient)
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import Callback
from transformers import ByT5Tokenizer

from helpers.accumulation import GradCapture
from helpers.models import tiny_llama
from lit_trainer.data.unpaired import UnpairedPreferenceDataModule
from lit_trainer.modules.kto import KTOModule

ROWS = {
    "prompt": ["1+2=", "100+200=", "5=", "a much longer prompt="],
    "completion": ["3", "301", "a longer completion here", "ok"],
    "label": [True, False, True, False],
}


class Batches(Callback):
    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})


if __name__ == "__main__":
    out = Path(sys.argv[1])
    pl.seed_everything(0)
    module = KTOModule(tiny_llama(0), ref_model=tiny_llama(1), beta=0.5, learning_rate=1e-3)
    dm = UnpairedPreferenceDataModule(
        tokenizer=ByT5Tokenizer(), dataset=Dataset.from_dict(ROWS), val_size=0, batch_size=2, max_length=48
    )
    capture, batches = GradCapture(), Batches()
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[capture, batches],
    )
    trainer.fit(module, datamodule=dm)
    torch.save({"batch": batches.batches[0], "grads": capture.grads[0]}, out / f"rank{trainer.global_rank}.pt")
