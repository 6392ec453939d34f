"""All the callbacks on one plain LightningModule (not from lit_trainer), then an exact resume."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.modules import TinyLM
from lit_trainer.callbacks import BEMA, BestCheckpoint, EvalOnStart, ExactResume, JITCheckpoint, NEFTune
from lit_trainer.data.loader import TrainLoader
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler


def _data(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"ids": torch.randint(0, 16, (6,), generator=g)} for _ in range(24)]


def _collate(rows: list[dict]) -> dict:
    return {"ids": torch.stack([r["ids"] for r in rows])}


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> TrainLoader:
        return TrainLoader(_data(), ShardedBatchSampler(24, 4, seed=3), _collate)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_data(1)[:8], batch_size=4, collate_fn=_collate)


def _trainer(root, max_steps, extra=()):
    callbacks = [
        NEFTune(noise_alpha=5.0, seed=11),
        EvalOnStart(),
        BEMA(update_freq=2, evaluate_with_bema=True),
        BestCheckpoint(dirpath=root / "best", monitor="val_loss", save_total_limit=2),
        ExactResume(),
        JITCheckpoint(dirpath=root / "jit", exit_code=None),
        *extra,
    ]
    return pl.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
    )


def test_all_callbacks_together_and_exact_resume(tmp_path):
    pl.seed_everything(0)
    full = TinyLM(dropout=0.3)
    _trainer(tmp_path / "a", 8).fit(full, datamodule=Data())
    pl.seed_everything(0)
    first = TinyLM(dropout=0.3)
    every3 = ModelCheckpoint(dirpath=tmp_path / "b" / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _trainer(tmp_path / "b", 3, [every3]).fit(first, datamodule=Data())
    pl.seed_everything(0)
    resumed = TinyLM(dropout=0.3)
    _trainer(tmp_path / "c", 8).fit(
        resumed, datamodule=Data(), ckpt_path=str(tmp_path / "b" / "ckpt" / "epoch=0-step=3.ckpt")
    )
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert any((tmp_path / "a" / "best").glob("*.ckpt"))
