"""DPOModule on 2 CPU ranks (gloo): a live-reference run and a precomputed-reference run with the same seed, then a
LoRA run (reference = adapters disabled) that saves a checkpoint.

21 training pairs (uneven shards for the precompute pass: 11 + 10 rows), 5 validation pairs, batch 4, 3 steps (one
epoch: ``max_steps`` and ``max_epochs`` both set).
Usage: python ddp_dpo.py OUT_DIR  (writes OUT_DIR/rank{0,1}.json, OUT_DIR/lora_rank{0,1}.json, OUT_DIR/lora.ckpt,
checked by tests/test_dpo_module.py::test_ddp_two_ranks_precompute_gathers_every_shard_and_matches_live)
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from transformers import ByT5Tokenizer

from helpers.models import tiny_llama
from lit_trainer.data import builtin
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.modules.dpo import DPOModule

TRAIN, VALIDATION = 21, 5


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def datamodule() -> PreferenceDataModule:
    return PreferenceDataModule(
        tokenizer=ByT5Tokenizer(),
        dataset=builtin.preference_rows("train").select(range(TRAIN)),
        validation_dataset=builtin.preference_rows("validation").select(range(VALIDATION)),
        batch_size=4,
        eval_batch_size=2,
        max_length=32,
    )


def ddp_trainer(**kw) -> pl.Trainer:
    """3 steps (one epoch) on 2 CPU ranks, no logger, checkpointing, progress bar, summary or sanity check; ``kw``
    adds to it. ``max_epochs`` set: ``estimated_stepping_batches`` builds the training loader before the precompute
    pass, whose columns must still reach every batch."""
    return pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=3,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


if __name__ == "__main__":
    out, result = Path(sys.argv[1]), {}
    for name, precompute in (("live", False), ("precomputed", True)):
        pl.seed_everything(0)
        module = DPOModule(tiny_llama(0), learning_rate=1e-3, beta=0.1, precompute_ref_log_probs=precompute)
        dm, losses = datamodule(), Losses()
        trainer = ddp_trainer(callbacks=[losses], val_check_interval=3, check_val_every_n_epoch=None)
        trainer.fit(module, datamodule=dm)
        result[name] = {
            "losses": losses.values,
            "ref_model_freed": module.ref_model is None,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }
        if precompute:
            result["ref_columns"] = {
                split: [list(ds["ref_chosen_logps"]), list(ds["ref_rejected_logps"])]
                for split, ds in (("train", dm.train_dataset), ("validation", dm.val_dataset))
            }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    lora = DPOModule(tiny_llama(0), peft_config={"r": 4, "target_modules": "all-linear"}, learning_rate=1e-2, beta=0.1)
    trainer = ddp_trainer(limit_val_batches=0)
    trainer.fit(lora, datamodule=datamodule())
    trainer.save_checkpoint(out / "lora.ckpt")
    base = dict(tiny_llama(0).named_parameters())
    frozen = {
        n.replace(".base_layer", ""): p for n, p in lora.model.get_base_model().named_parameters() if "lora_" not in n
    }
    (out / f"lora_rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "adapters": {n: p.detach().double().sum().item() for n, p in lora.trainable_parameters()},
                "base_unchanged": all(torch.equal(frozen[n], p) for n, p in base.items()),
                "reference": type(lora.ref_model).__name__,
            }
        )
    )
