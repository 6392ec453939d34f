"""BEMA(update_ref_model=True) on the real DPOModule: the reference model receives the BEMA weights on schedule."""

import lightning.pytorch as pl
import torch
from datasets import Dataset

from lit_trainer import DPOModule
from lit_trainer.callbacks import BEMA
from lit_trainer.data import PreferenceDataModule


def test_bema_refreshes_the_dpo_reference_model(tmp_path):
    pl.seed_everything(0)
    rows = Dataset.from_dict(
        {
            "prompt": [f"{a}+1=" for a in range(10, 26)],
            "chosen": [str(a + 1) for a in range(10, 26)],
            "rejected": [str(a + 2) for a in range(10, 26)],
        }
    )
    module = DPOModule("tiny-64", loss_type=["sigmoid"], learning_rate=1e-2)
    data = PreferenceDataModule("tiny-64", dataset=rows, val_size=0, batch_size=4, max_length=16)
    snapshots = {}

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots[trainer.global_step] = {k: v.clone() for k, v in pl_module.ref_model.state_dict().items()}

    bema = BEMA(update_freq=1, update_ref_model=True, ref_model_update_freq=2, export_hf=False)
    # Snapshot runs after BEMA (list order), so it sees the reference model as BEMA left it at each step
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[bema, Snapshot()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    weights = {k.removeprefix("model."): v for k, v in bema.bema_state_dict().items()}
    final = snapshots[4]
    for name, value in weights.items():
        assert torch.equal(final[name], value), name  # step 4 is a scheduled refresh: ref == BEMA exactly
    changed = [n for n in weights if not torch.equal(snapshots[1][n], snapshots[2][n])]
    assert changed  # refreshed at step 2
    assert all(torch.equal(snapshots[2][n], snapshots[3][n]) for n in weights)  # untouched at step 3
    assert all(not p.requires_grad for p in module.ref_model.parameters())
