"""AtomicCheckpointIO as a plugin of a ``pytorch_lightning.Trainer`` (its twin class)."""

from __future__ import annotations

import pytest

pl = pytest.importorskip("pytorch_lightning")  # an optional extra; installed with the test extra

from pytorch_lightning.demos.boring_classes import BoringModel  # noqa: E402

from lit_trainer.callbacks.pytorch_lightning import AtomicCheckpointIO  # noqa: E402
from lit_trainer.checkpoint_io import AtomicCheckpointIO as LightningAtomicCheckpointIO  # noqa: E402


def test_pytorch_lightning_trainer_takes_the_twin_and_writes_through_it(tmp_path, monkeypatch):
    written = []
    io = AtomicCheckpointIO()
    original = io.checkpoint_io.save_checkpoint
    monkeypatch.setattr(
        io.checkpoint_io, "save_checkpoint", lambda c, p, **kw: (written.append(p), original(c, p, **kw))
    )
    trainer = pl.Trainer(
        max_steps=2,
        plugins=[io],
        default_root_dir=tmp_path,
        logger=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    assert trainer.strategy.checkpoint_io is io
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert files == ["epoch=0-step=2.ckpt"]  # no partial left behind
    assert [str(p).rsplit("/", 1)[-1] for p in written] == [".epoch=0-step=2.ckpt.partial"]  # written, then renamed


def test_each_package_refuses_the_other_packages_plugin():
    with pytest.raises(Exception, match="CheckpointIO|plugin"):
        pl.Trainer(plugins=[LightningAtomicCheckpointIO()], logger=False)
