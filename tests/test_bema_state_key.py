"""BEMA's checkpoint state is keyed by its settings: two BEMA callbacks in one trainer save and resume separately."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from helpers.modules import Regressor
from lit_trainer.callbacks import BEMA

SLOW = dict(update_freq=1, ema_power=0.9, lag=1.0)
FAST = dict(update_freq=2, ema_power=0.2, bias_power=0.5)


def _fit(root: Path, callbacks: list, max_steps: int = 8, **kw) -> None:
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(Regressor(hidden=None, lr=0.1, seed=0), data, **kw)  # seeded: every fit starts from the same weights


def _weights(bema: BEMA) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in bema.bema_state_dict().items()}


def test_two_bema_callbacks_save_and_resume_their_own_average(tmp_path: Path) -> None:
    full = [BEMA(**SLOW), BEMA(**FAST)]
    _fit(tmp_path / "a", full)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    _fit(tmp_path / "b", [BEMA(**SLOW), BEMA(**FAST), saver], max_steps=3)
    ckpt = tmp_path / "ckpt" / "step=3.ckpt"
    states = torch.load(ckpt, weights_only=True)["callbacks"]
    keys = [k for k in states if k.startswith("BEMA")]
    assert len(keys) == 2 and keys[0] != keys[1]
    resumed = [BEMA(**FAST), BEMA(**SLOW)]  # another order: each finds its own state by its settings
    _fit(tmp_path / "c", resumed, ckpt_path=ckpt)
    for done, again in zip(full, reversed(resumed)):
        for name, value in _weights(done).items():
            torch.testing.assert_close(_weights(again)[name], value, rtol=0, atol=0)
    assert not torch.equal(_weights(full[0])["net.weight"], _weights(full[1])["net.weight"])
    for bema in resumed:
        key = next(k for k in keys if k == bema.state_key)
        torch.testing.assert_close(  # the saved tensor read back: exact
            BEMA.bema_weights_from_checkpoint(ckpt, state_key=key)["net.weight"],
            states[key]["bema"]["net.weight"],
            rtol=0,
            atol=0,
        )
    with pytest.raises(ValueError, match="2 BEMA states.*state_key="):
        BEMA.bema_weights_from_checkpoint(ckpt)


def test_a_checkpoint_keyed_by_class_name_still_resumes(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    first = BEMA(**SLOW)
    _fit(tmp_path / "b", [first, saver], max_steps=3)
    ckpt = torch.load(tmp_path / "ckpt" / "step=3.ckpt", weights_only=True)
    ckpt["callbacks"] = {"BEMA": ckpt["callbacks"][first.state_key]}  # the layout before state keys had settings
    torch.save(ckpt, tmp_path / "old.ckpt")
    full, resumed = BEMA(**SLOW), BEMA(**SLOW)
    _fit(tmp_path / "a", [full])
    _fit(tmp_path / "c", [resumed], ckpt_path=tmp_path / "old.ckpt")
    torch.testing.assert_close(_weights(resumed)["net.weight"], _weights(full)["net.weight"], rtol=0, atol=0)
    assert BEMA.bema_weights_from_checkpoint(tmp_path / "old.ckpt")["net.weight"].shape == (1, 4)


def test_changed_settings_continue_the_single_saved_average_with_a_warning(tmp_path: Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    _fit(tmp_path / "b", [BEMA(**SLOW), saver], max_steps=3)
    resumed = BEMA(**FAST)
    with pytest.warns(UserWarning, match="BEMA resumes a state made with"):
        _fit(tmp_path / "c", [resumed], max_steps=3, ckpt_path=tmp_path / "ckpt" / "step=3.ckpt")
    assert resumed.state_dict()["step"] == 3 and resumed.state_dict()["num_updates"] == 3
