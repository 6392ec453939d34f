"""AtomicCheckpointIO: an interrupted write never leaves a file under the final name (Lightning's TorchCheckpointIO
can, when its temporary file is on another file system); BestCheckpoint installs it; distributed checkpoint
folders, which bypass the plugin, are marked incomplete while written."""

from __future__ import annotations

import math
import os
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import fsspec
import fsspec.implementations.local as fsspec_local
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_trainer.callbacks import BestCheckpoint
from lit_trainer.callbacks.resume_choice import resolve_resume_checkpoint
from lit_trainer.checkpoint_io import SENTINEL_NAME, AtomicCheckpointIO

# the monitored value by optimizer step: a first best at step 2, a new best at step 4
SCORES = {2: 3.0, 4: 2.0}


class _Killed(Exception):
    """The process died here."""


def _interrupt_moves(monkeypatch: pytest.MonkeyPatch, after: int = 0) -> None:
    """fsspec moves Lightning's temporary file onto the target with ``shutil.move``: a copy when the temporary folder
    is on another file system. Simulate a kill halfway through that copy, from the ``after+1``-th move on."""
    calls, real_move = {"n": 0}, shutil.move

    def move(src: str, dst: str) -> None:
        calls["n"] += 1
        if calls["n"] <= after:
            real_move(src, dst)
            return
        data = Path(src).read_bytes()
        Path(dst).write_bytes(data[: len(data) // 2])
        os.unlink(src)  # a real kill leaves it in $TMPDIR; keep the machine clean
        raise _Killed("killed while copying the checkpoint")

    monkeypatch.setattr(fsspec_local.shutil, "move", move)


def _checkpoint(step: int) -> dict:
    return {"step": step, "state_dict": {"w": torch.full((64, 64), float(step))}}


def test_lightning_torch_checkpoint_io_leaves_a_truncated_file_under_the_final_name(
    tmp_path: Path, monkeypatch
) -> None:
    # what AtomicCheckpointIO is for: Lightning 2.6's own writer is atomic only when $TMPDIR shares the file system
    target = tmp_path / "step=1.ckpt"
    _interrupt_moves(monkeypatch)
    with pytest.raises(_Killed):
        TorchCheckpointIO().save_checkpoint(_checkpoint(1), target)
    assert target.exists() and not zipfile.is_zipfile(target)


def test_an_interrupted_write_keeps_the_previous_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(1), target)
    _interrupt_moves(monkeypatch)
    with pytest.raises(_Killed):
        io.save_checkpoint(_checkpoint(2), str(target))
    assert sorted(os.listdir(tmp_path)) == [".last.ckpt.partial", "last.ckpt"]
    assert io.load_checkpoint(target)["step"] == 1  # the previous checkpoint, complete
    io.remove_checkpoint(target)
    assert os.listdir(tmp_path) == [".last.ckpt.partial"]


def test_remote_paths_and_background_writers(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(3), "memory://run/step=3.ckpt")  # fsspec's in-memory store: no rename
    memory = fsspec.filesystem("memory")
    assert memory.ls("/run", detail=False) == ["/run/step=3.ckpt"]
    memory.rm("/run", recursive=True)
    with pytest.raises(TypeError, match="AsyncCheckpointIO"):
        AtomicCheckpointIO(AsyncCheckpointIO())
    with pytest.raises(TypeError, match="needs a CheckpointIO"):
        AtomicCheckpointIO(object())  # type: ignore[arg-type]


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[0].sum(1, keepdim=True))

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_score", SCORES[self.global_step])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _trainer(tmp_path: Path, callbacks: list, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        **kw,
    )


def test_best_checkpoint_interrupted_mid_write_keeps_the_previous_best(tmp_path: Path, monkeypatch) -> None:
    cb = BestCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", monitor="val_score", mode="min")
    trainer = _trainer(tmp_path, [cb])
    _interrupt_moves(monkeypatch, after=1)  # the first best (step 2) is written, the second (step 4) is not
    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    with pytest.raises(_Killed):
        trainer.fit(Regressor(), data, data)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".step=4.ckpt.partial", "step=2.ckpt"]
    previous = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=True)
    assert previous["global_step"] == 2 and previous["callbacks"][cb.state_key]["best_model_score"] == 3.0
    assert resolve_resume_checkpoint(tmp_path / "ckpt") == str(tmp_path / "ckpt" / "step=2.ckpt")


def test_best_checkpoint_installs_the_plugin_once_and_only_for_local_synchronous_writes(tmp_path: Path) -> None:
    def setup(dirpath: str | Path, **kw) -> pl.Trainer:
        trainer = _trainer(tmp_path, [], **kw)
        for _ in range(2):  # a second fit does not wrap twice
            BestCheckpoint(dirpath=dirpath, monitor="val_score").setup(trainer, Regressor(), "fit")
        return trainer

    io = setup(tmp_path / "ckpt").strategy.checkpoint_io
    assert isinstance(io, AtomicCheckpointIO) and type(io.checkpoint_io) is TorchCheckpointIO
    assert isinstance(
        setup(tmp_path / "ckpt", plugins=[AsyncCheckpointIO()]).strategy.checkpoint_io, AsyncCheckpointIO
    )  # its write still runs when save_checkpoint returns: nothing to rename
    assert type(setup("memory://ckpt").strategy.checkpoint_io) is TorchCheckpointIO  # object stores


def test_a_distributed_checkpoint_folder_is_marked_incomplete_while_written(tmp_path: Path) -> None:
    # ModelParallelStrategy writes its folder itself (not through checkpoint_io): the sentinel names it meanwhile
    cb = BestCheckpoint(dirpath=tmp_path, filename="{step}", monitor="val_score")
    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), is_global_zero=True, global_step=3)
    assert cb.check_monitor_top_k(trainer, torch.tensor(1.0)) and not cb.check_monitor_top_k(
        trainer, torch.tensor(math.nan)
    )
    assert cb.check_monitor_top_k(trainer, torch.tensor(1.0))  # (no best yet: any number improves)
    cb.best_model_path = str(tmp_path / "step=3.ckpt")  # as ModelCheckpoint does just before saving
    cb.on_save_checkpoint(trainer, None, {"state_dict": {}})
    (tmp_path / "step=3.ckpt").mkdir()  # the strategy's shards, being written
    assert (tmp_path / SENTINEL_NAME).read_text().splitlines()[-1] == "target: step=3.ckpt"
    assert resolve_resume_checkpoint(tmp_path) is None


def test_usable_as_a_trainer_plugin_without_best_checkpoint(tmp_path: Path, monkeypatch) -> None:
    trainer = pl.Trainer(
        max_steps=2,
        plugins=[AtomicCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # Lightning's own ModelCheckpoint
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    _interrupt_moves(monkeypatch)
    with pytest.raises(_Killed):
        trainer.fit(Regressor(), data)
    assert os.listdir(tmp_path / "checkpoints") == [".epoch=0-step=2.ckpt.partial"]
