"""Files the project writes get the modes the user's umask gives (0o666 & ~umask, folders 0o777 & ~umask), also when
the writer behind an atomic write stages through ``mkstemp`` (0o600): exports and checkpoints must be readable by
the others the umask lets read them on a shared cluster."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers.modules import TinyHF
from lit_trainer.callbacks.checkpointing import BestCheckpoint
from lit_trainer.callbacks.hf_export import export_hf
from lit_trainer.checkpoint_io import AtomicCheckpointIO
from lit_trainer.core import atomic as _atomic
from lit_trainer.modules.reference._ref_logps import save_cached

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _modes(folder: Path) -> dict[str, int]:
    """The mode of ``folder`` and of everything in it, by path relative to ``folder``."""
    found = {".": _mode(folder)}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            found[str(path.relative_to(folder))] = _mode(path)
    return found


def _expected(folder: Path, umask: int) -> dict[str, int]:
    return {name: (0o777 if (folder / name).is_dir() else 0o666) & ~umask for name in _modes(folder)}


def test_current_umask_reads_the_process_umask(umask: int) -> None:
    assert _atomic.current_umask() == umask
    assert os.umask(umask) == umask  # reading it left it unchanged


def test_commit_gives_mkstemp_files_and_private_folders_the_umask_modes(tmp_path: Path, umask: int) -> None:
    fd, name = tempfile.mkstemp(dir=tmp_path)  # 0o600, as safetensors' writer leaves its files
    os.close(fd)
    _atomic.commit(name, tmp_path / "weights.bin")
    assert _mode(tmp_path / "weights.bin") == 0o666 & ~umask
    staged = Path(tempfile.mkdtemp(dir=tmp_path))  # 0o700
    (staged / "sub").mkdir(mode=0o700)
    for path in (staged / "a.txt", staged / "sub" / "b.txt"):
        path.write_text("x")
        path.chmod(0o600)
    _atomic.commit(staged, tmp_path / "folder")
    assert _modes(tmp_path / "folder") == _expected(tmp_path / "folder", umask)


def test_hf_export_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    import transformers

    export_hf(TinyHF().model, transformers.ByT5Tokenizer(), tmp_path / "export")
    modes = _modes(tmp_path / "export")
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == _expected(tmp_path / "export", umask)


def test_dpo_reference_cache_follows_the_umask(tmp_path: Path, umask: int) -> None:
    target = save_cached(tmp_path / "cache", "key", torch.zeros(3), torch.ones(3))
    assert _mode(target) == 0o666 & ~umask


def test_checkpoint_io_file_follows_the_umask(tmp_path: Path, umask: int) -> None:
    AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, tmp_path / "ckpt" / "step=1.ckpt")
    assert _mode(tmp_path / "ckpt" / "step=1.ckpt") == 0o666 & ~umask


class _Scored(TinyHF):
    """A tiny transformers module with a tokenizer, logging a score that improves at every validation."""

    def __init__(self) -> None:
        import transformers

        super().__init__(lr=1e-2, optimizer="adamw")
        self.tokenizer = transformers.ByT5Tokenizer()

    def validation_step(self, batch, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("val_score", -float(self.global_step))


def test_best_checkpoint_files_and_export_follow_the_umask(tmp_path: Path, umask: int) -> None:
    pl.seed_everything(0)
    ids = torch.randint(3, 259, (8, 12), generator=torch.Generator().manual_seed(0))
    cb = BestCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", monitor="val_score", mode="min", export_hf=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[cb],
        default_root_dir=tmp_path,
    )
    trainer.fit(_Scored(), DataLoader(TensorDataset(ids), batch_size=4), DataLoader(TensorDataset(ids), batch_size=4))
    modes = _modes(tmp_path / "ckpt")
    assert {"step=2.ckpt", "best", "best/model.safetensors"} <= set(modes)
    assert modes == _expected(tmp_path / "ckpt", umask)
