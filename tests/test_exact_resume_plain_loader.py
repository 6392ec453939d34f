"""ExactResume on a plain LightningModule with a plain shuffled ``DataLoader`` and dropout: a run resumed from a
checkpoint taken mid-epoch, at an epoch boundary or inside an accumulation window (``trainer.save_checkpoint`` or a
validation's checkpoint callback) ends with the uninterrupted run's weights, bit for bit, and trains the same samples
in the same order; under ``lightning.pytorch`` and under ``pytorch_lightning`` (its callback twins)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning
import torch
from torch.utils.data import DataLoader

from helpers.modules import DropoutRegressor, on_pytorch_lightning
from lit_trainer.callbacks import ExactResume
from lit_trainer.callbacks import pytorch_lightning as pl_callbacks

ROWS, BATCH = 24, 4  # 6 batches an epoch


def _plain_module(ns: Any) -> type:
    """What any Lightning project writes (``import lightning as L`` or ``import pytorch_lightning as pl``): no
    lit_trainer module, data module or loader."""
    return DropoutRegressor if ns is L else on_pytorch_lightning(DropoutRegressor)


NAMESPACES = {"lightning": L, "pytorch_lightning": pytorch_lightning}


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, generator=g)
    return list(zip(x, y, strict=True))


class _Seen(L.Callback):
    """The samples each training batch holds (their targets), and a mid-window checkpoint on request."""

    def __init__(self, save_after: int | None = None, path: Path | None = None) -> None:
        self.batches: list[list[float]] = []
        self.save_after, self.path = save_after, path

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append([round(float(v), 4) for v in batch[1]])

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if len(self.batches) == self.save_after and self.path is not None:
            trainer.save_checkpoint(self.path)


def _fit(
    root: Path,
    loader_kwargs: dict,
    epochs: int = 3,
    accumulate: int = 1,
    ckpt: Path | None = None,
    extra: tuple = (),
    ns: Any = L,
    val_check_interval: int | None = None,
) -> tuple[Any, list[list[float]]]:
    seen = next((c for c in extra if isinstance(c, _Seen)), None) or _Seen()
    exact = ExactResume if ns is L else pl_callbacks.ExactResume  # each package has its own callback classes
    callbacks = [exact(), seen, *(c for c in extra if c is not seen)]
    ns.seed_everything(0)
    module = _plain_module(ns)()
    trainer = ns.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        enable_checkpointing=any(isinstance(c, ns.callbacks.ModelCheckpoint) for c in extra),
        callbacks=callbacks,
        val_check_interval=val_check_interval,
        limit_val_batches=1.0 if val_check_interval else 0,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True, **loader_kwargs)
    val = DataLoader(_data()[:8], batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader, val, ckpt_path=ckpt)
    # neither ExactResume ("not exact") nor Lightning ("dataloader is not resumable") may warn
    assert not [str(w.message) for w in caught if "ExactResume" in str(w.message) or "resumable" in str(w.message)]
    return module, seen.batches


def _same_weights(a: Any, b: Any) -> bool:
    assert all(torch.isfinite(x).all() for x in a.state_dict().values())
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.parametrize(
    ("namespace", "generator"), [("lightning", False), ("lightning", True), ("pytorch_lightning", False)]
)
def test_plain_shuffled_dataloader_resumes_exactly_mid_epoch_and_at_epoch_boundaries(
    tmp_path: Path, namespace: str, generator: bool
) -> None:
    ns = NAMESPACES[namespace]
    kwargs = {"generator": torch.Generator().manual_seed(5)} if generator else {}
    every_step = ns.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)
    full, full_batches = _fit(tmp_path, kwargs, extra=(every_step,), ns=ns)
    assert len(full_batches) == 18 and full_batches[:6] != full_batches[6:12]  # shuffled differently every epoch
    # step 3: mid-epoch 0; step 6: the end of epoch 0; step 9: mid-epoch 1
    for step, trained in ((3, 3), (6, 6), (9, 9)):
        kwargs = {"generator": torch.Generator().manual_seed(5)} if generator else {}
        resumed, batches = _fit(
            tmp_path, kwargs, ckpt=tmp_path / "ck" / f"epoch={(step - 1) // 6}-step={step}.ckpt", ns=ns
        )
        assert batches == full_batches[trained:], f"resumed from step {step}: other samples or order"
        assert _same_weights(full, resumed), f"resumed from step {step}: other weights"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_plain_dataloader_checkpoint_inside_an_accumulation_window_resumes_exactly(tmp_path: Path, namespace: str):
    # accumulate 2: a checkpoint after 3 micro-batches is half-way through step 1 (micro-batches 2 and 3)
    ns, path = NAMESPACES[namespace], tmp_path / "mid_window.ckpt"
    full, full_batches = _fit(tmp_path, {}, epochs=2, accumulate=2, extra=(_Seen(save_after=3, path=path),), ns=ns)
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 1 and len(state["callbacks"]["ExactResume"]["window_grads"]) == 1
    resumed, batches = _fit(tmp_path, {}, epochs=2, accumulate=2, ckpt=path, ns=ns)
    assert batches == full_batches[3:]
    assert _same_weights(full, resumed)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_validation_inside_an_accumulation_window_with_a_checkpoint_callback_resumes_exactly(
    tmp_path: Path, namespace: str
):
    # accumulate 2, a validation every 3 micro-batches: the first one (and its checkpoint) falls half-way through step 1
    ns = NAMESPACES[namespace]
    saves = [ns.callbacks.ModelCheckpoint(dirpath=tmp_path / d, monitor="val_loss", save_top_k=-1) for d in "ab"]
    full, full_batches = _fit(tmp_path, {}, epochs=2, accumulate=2, extra=(saves[0],), ns=ns, val_check_interval=3)
    path = tmp_path / "a" / "epoch=0-step=1.ckpt"
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 1 and len(state["callbacks"]["ExactResume"]["window_grads"]) == 1
    resumed, batches = _fit(
        tmp_path, {}, epochs=2, accumulate=2, ckpt=path, extra=(saves[1],), ns=ns, val_check_interval=3
    )
    assert batches == full_batches[3:]
    assert _same_weights(full, resumed)


def test_without_the_replay_the_resumed_order_differs(tmp_path: Path):
    """The counter-example the test above rules out: Lightning alone builds the resumed epoch from other RNG states."""
    every_step = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)
    _, full_batches = _fit(tmp_path, {}, epochs=2, extra=(every_step,))
    L.seed_everything(0)
    seen = _Seen()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[seen],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(
            _plain_module(L)(),
            DataLoader(_data(), batch_size=BATCH, shuffle=True),
            ckpt_path=tmp_path / "ck" / "epoch=0-step=6.ckpt",
        )
    assert seen.batches != full_batches[6:]
