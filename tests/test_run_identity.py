"""RunIdentity on plain Lightning (no CLI): the record is written, another module's checkpoint is refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_trainer.callbacks import RunIdentity


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)


class _OtherNet(_Net):
    pass


def _trainer(tmp_path, name: str, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=CSVLogger(tmp_path, name=name, version=0),
        callbacks=[RunIdentity()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_record_is_written_and_the_same_run_resumes(tmp_path):
    first = _trainer(tmp_path, "a", 2)
    first.fit(_Net())
    ckpt = tmp_path / "a" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt"
    record = torch.load(ckpt, weights_only=False)["lit_trainer_run"]
    assert record == {
        "module": f"{__name__}._Net",
        "datamodule": None,
        "run_name": "a",
        "run_dir": str(tmp_path / "a" / "version_0"),
    }
    again = _trainer(tmp_path, "a", 3)
    again.fit(_Net(), ckpt_path=ckpt)
    assert again.global_step == 3


def test_another_module_class_or_run_name_is_refused(tmp_path):
    _trainer(tmp_path, "a", 2).fit(_Net())
    ckpt = tmp_path / "a" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt"
    with pytest.raises(ValueError, match=r"module: checkpoint '.*\._Net', this run '.*\._OtherNet'"):
        _trainer(tmp_path, "a", 3).fit(_OtherNet(), ckpt_path=ckpt)
    with pytest.raises(ValueError, match=r"run_name: checkpoint 'a', this run 'b'"):
        _trainer(tmp_path, "b", 3).fit(_Net(), ckpt_path=ckpt)


def test_a_checkpoint_without_record_loads_with_a_warning(tmp_path):
    _trainer(tmp_path, "a", 2).fit(_Net())
    ckpt = tmp_path / "a" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt"
    state = torch.load(ckpt, weights_only=False)
    del state["lit_trainer_run"]
    torch.save(state, tmp_path / "plain.ckpt")
    with pytest.warns(UserWarning, match="has no lit_trainer run record"):
        _trainer(tmp_path, "a", 3).fit(_Net(), ckpt_path=tmp_path / "plain.ckpt")
