"""BEMA(evaluate_with_bema=True) + BestCheckpoint: the weights that were scored are the ones kept, loaded, exported."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers.modules import TinyHF
from lit_trainer.callbacks import BEMA, BestCheckpoint


def _loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (48, 10), generator=g)
    # two steps per epoch and validation every two steps: the best checkpoint is at an epoch end (exact resume)
    return DataLoader(TensorDataset(ids[:8]), batch_size=4), DataLoader(TensorDataset(ids[32:]), batch_size=16)


def _trainer(root: Path, callbacks: list, **kw) -> pl.Trainer:
    return pl.Trainer(
        max_steps=16,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **kw,
    )


def _val_loss(module: pl.LightningModule, val: DataLoader) -> float:
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    return trainer.validate(module, val, verbose=False)[0]["val_loss"]


def test_the_scored_weights_are_loaded_and_exported_and_the_checkpoint_still_resumes(tmp_path: Path) -> None:
    import transformers

    train, val = _loaders()
    bema = BEMA(update_freq=1, lag=1.0, evaluate_with_bema=True, export_hf=False)
    best = BestCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", load_best_at_end=True, export_hf=True)
    module = TinyHF(lr=2.0, vocab=64, hidden=16, positions=32)
    _trainer(tmp_path, [bema, best]).fit(module, train, val)

    # the module now holds weights whose val_loss is the best score
    assert _val_loss(module, val) == pytest.approx(float(best.best_model_score), rel=1e-5)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "best").state_dict()
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)
    # the checkpoint keeps the live weights for resuming (they differ from the scored BEMA weights)
    ckpt = torch.load(best.best_model_path, weights_only=True)
    live = ckpt["state_dict"]["model.lm_head.weight"]
    assert not torch.allclose(live, module.model.lm_head.weight.detach())
    scored = ckpt["evaluated_weights"]  # tied embedding / LM head: one stored copy, as in the live state_dict
    assert scored["model.lm_head.weight"].data_ptr() == scored["model.model.embed_tokens.weight"].data_ptr()
    bema_state = ckpt["callbacks"][bema.state_key]["bema"]
    torch.testing.assert_close(bema_state["model.model.embed_tokens.weight"], module.model.lm_head.weight.detach())

    resumed_bema = BEMA(update_freq=1, lag=1.0, evaluate_with_bema=True, export_hf=False)
    resumed = TinyHF(lr=2.0, vocab=64, hidden=16, positions=32)
    _trainer(tmp_path / "r", [resumed_bema], enable_checkpointing=False).fit(
        resumed, train, val, ckpt_path=best.best_model_path
    )
    full_bema = BEMA(update_freq=1, lag=1.0, evaluate_with_bema=True, export_hf=False)
    full = TinyHF(lr=2.0, vocab=64, hidden=16, positions=32)
    _trainer(tmp_path / "f", [full_bema], enable_checkpointing=False).fit(full, train, val)
    for name, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=1e-6, atol=1e-7)


def test_weights_only_checkpoints_and_two_scoring_callbacks_are_refused(tmp_path: Path) -> None:
    train, val = _loaders()
    callbacks = [
        BEMA(update_freq=1, evaluate_with_bema=True, export_hf=False),
        BestCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_weights_only=True),
    ]
    with pytest.raises(ValueError, match=r"save_weights_only=True.*BEMA.*save_weights_only=False"):
        _trainer(tmp_path, callbacks).fit(TinyHF(lr=2.0, vocab=64, hidden=16, positions=32), train, val)
    callbacks = [
        BEMA(update_freq=1, evaluate_with_bema=True, export_hf=False),
        BEMA(update_freq=2, evaluate_with_bema=True, export_hf=False),
        BestCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss"),
    ]
    with pytest.raises(ValueError, match=r"\['BEMA', 'BEMA'\] all validate with other weights"):
        _trainer(tmp_path, callbacks).fit(TinyHF(lr=2.0, vocab=64, hidden=16, positions=32), train, val)
