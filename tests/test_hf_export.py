"""HFExport: refuses a module without a transformers model before training, not after it."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_trainer.callbacks import HFExport


class Plain(pl.LightningModule):
    """A user's module without `.model`: nothing HFExport can `save_pretrained`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.steps = 0

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return torch.nn.functional.mse_loss(self.lin(batch[0]).squeeze(-1), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NotHF(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(2, 2)  # a `.model`, but no `save_pretrained`


@pytest.mark.parametrize("module_cls, missing", [(Plain, "has no `.model`"), (NotHF, "is a Linear")])
def test_refused_before_the_first_step_with_the_fix(tmp_path: Path, module_cls, missing: str) -> None:
    module = module_cls()
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=3,
        callbacks=[HFExport(dirpath=tmp_path / "hf")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(TypeError, match=rf"HFExport needs `{module_cls.__name__}.model`.*{missing}.*remove HFExport"):
        trainer.fit(module, data)
    assert module.steps == 0 and not (tmp_path / "hf").exists()
