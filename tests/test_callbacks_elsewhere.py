"""The callbacks in Lightning projects not written here, under both ``lightning`` and ``pytorch_lightning``: plain
LightningModules (``tests/helpers/modules.py``) with plain DataLoaders.

* Lightning's own ``trainer.fit(..., ckpt_path="last")`` continues from the ``JITCheckpoint`` a SIGTERM wrote: with the
  default ``ModelCheckpoint``, beside a ``ModelCheckpoint(save_last=True)`` whose ``last.ckpt`` is older, and beside a
  hydra-template-style ``ModelCheckpoint`` with its own folder and file names.
* ``BestCheckpoint`` finishes ``fit`` when the module's hyperparameters hold a ``Path``, a class and a
  ``functools.partial`` (it reads its checkpoints back for ``load_best_at_end`` and ``export_hf``), and the safe
  loader behind it builds nothing that ``weights_only`` would refuse.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

import lit_trainer.callbacks as lightning_callbacks
from helpers.modules import Regressor, _Regressor, _TinyHF, on_pytorch_lightning
from lit_trainer.callbacks import pytorch_lightning as pl_callbacks
from lit_trainer.checkpoint_load import Unloaded, load_checkpoint

PACKAGES = ["lightning", "pytorch_lightning"]


def _package(name: str) -> tuple[Any, Any]:
    """``(the Lightning package, lit_trainer's callbacks for it)``."""
    if name == "lightning":
        return L, lightning_callbacks
    import pytorch_lightning

    return pytorch_lightning, pl_callbacks


def _loaders() -> tuple[DataLoader, DataLoader]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    data = TensorDataset(x, x.sum(-1, keepdim=True))
    return DataLoader(data, batch_size=8), DataLoader(data, batch_size=32)


def _sigterm_at(package: Any, step: int) -> Any:
    class SigtermAt(package.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == step and not getattr(self, "sent", False):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    return SigtermAt()


class _FirstStep:
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.step = trainer.global_step


def _first_step(package: Any) -> Any:
    return type("FirstStep", (_FirstStep, package.Callback), {})()


def _checkpoints(package: Any, setup: str, root: Path) -> list:
    if setup == "default_model_checkpoint":  # Lightning adds one (no save_last) when none is given
        return []
    if setup == "save_last":  # writes last.ckpt at step 3: older than the JIT checkpoint of step 4
        return [package.callbacks.ModelCheckpoint(save_last=True, every_n_train_steps=3, save_top_k=-1)]
    # hydra-template style: its own folder and names, save_last
    return [
        package.callbacks.ModelCheckpoint(
            dirpath=root / "outputs" / "checkpoints", filename="epoch_{epoch:03d}", save_last=True, save_top_k=1
        )
    ]


@pytest.mark.parametrize("setup", ["default_model_checkpoint", "save_last", "hydra_style"])
@pytest.mark.parametrize("package_name", PACKAGES)
def test_lightning_ckpt_path_last_continues_from_the_jit_checkpoint(
    package_name: str, setup: str, tmp_path: Path
) -> None:
    package, callbacks = _package(package_name)
    module_class = Regressor if package_name == "lightning" else on_pytorch_lightning(Regressor)
    options = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    options |= {"default_root_dir": tmp_path, "max_steps": 6, "limit_val_batches": 0}
    jit = callbacks.JITCheckpoint(kill_wait=0)  # the default: exit with 143 after the save, as on a cluster
    stopped = package.Trainer(
        callbacks=[jit, _sigterm_at(package, 3), *_checkpoints(package, setup, tmp_path)], **options
    )
    with pytest.raises(SystemExit) as exited:
        stopped.fit(module_class(seed=0), *_loaders())
    assert exited.value.code == 143 and stopped.global_step == 4
    assert Path(jit.checkpoint_path).name == "last-jit-epoch=0-step=4.ckpt"
    expected_folder = tmp_path / ("outputs" if setup == "hydra_style" else "") / "checkpoints"
    assert Path(jit.checkpoint_path).parent == expected_folder  # beside the project's own checkpoints

    first = _first_step(package)
    relaunched = package.Trainer(callbacks=[first, *_checkpoints(package, setup, tmp_path)], **options)
    relaunched.fit(module_class(seed=1), *_loaders(), ckpt_path="last")  # Lightning's own "last"
    assert relaunched.ckpt_path == jit.checkpoint_path and first.step == 4 and relaunched.global_step == 6


def test_the_jit_message_says_how_to_continue(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    options |= {"default_root_dir": tmp_path, "max_steps": 6, "limit_val_batches": 0}
    for checkpointing, expected in ((True, 'fit(..., ckpt_path="last") continues from it'), (False, "ckpt_path='")):
        jit = lightning_callbacks.JITCheckpoint(kill_wait=0, exit_code=None)
        trainer = L.Trainer(callbacks=[jit, _sigterm_at(L, 1)], enable_checkpointing=checkpointing, **options)
        with caplog.at_level("INFO"):
            trainer.fit(Regressor(seed=0), *_loaders())
        assert expected in caplog.text, caplog.text[-500:]
        caplog.clear()
    # under a logger the run's folder is its version folder, which a relaunch does not reuse unless told to
    jit = lightning_callbacks.JITCheckpoint(kill_wait=0, exit_code=None)
    logged = {**options, "logger": L.loggers.CSVLogger(tmp_path / "logs")}
    with caplog.at_level("INFO"):
        L.Trainer(callbacks=[jit, _sigterm_at(L, 1)], **logged).fit(Regressor(seed=0), *_loaders())
    assert "only if the relaunch logs to the same logger version" in caplog.text, caplog.text[-500:]


class _Hydra:
    """A module configured the hydra/jsonargparse way: a path, a class and a partial among its hyperparameters."""

    def __init__(self, data_dir: Path, optimizer_class: type, scheduler: functools.partial, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()


HPARAMS = {
    "data_dir": Path("data") / "train",
    "optimizer_class": torch.optim.AdamW,
    "scheduler": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2),
}


@pytest.mark.parametrize("package_name", PACKAGES)
def test_best_checkpoint_loads_the_best_and_exports_despite_unusual_hparams(package_name: str, tmp_path: Path) -> None:
    package, callbacks = _package(package_name)
    base = L.LightningModule if package_name == "lightning" else package.LightningModule
    regressor = type("HydraRegressor", (_Hydra, _Regressor, base), {})
    module = regressor(**HPARAMS, seed=0)
    best = callbacks.BestCheckpoint(dirpath=tmp_path / "best", monitor="val_loss", load_best_at_end=True)
    options = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = package.Trainer(max_epochs=2, callbacks=[best], default_root_dir=tmp_path, **options)
    trainer.fit(module, *_loaders())  # raised before: weights_only refused the PosixPath in the hyperparameters
    best_state = load_checkpoint(best.best_model_path)
    assert isinstance(best_state["hyper_parameters"]["data_dir"], Unloaded)
    for name, value in module.state_dict().items():
        assert torch.equal(value, best_state["state_dict"][name])  # the best weights are the module's at the end

    hf_module = type("HydraLM", (_Hydra, _TinyHF, base), {})(**HPARAMS, vocab=32, hidden=8, positions=16, seed=0)
    ids = DataLoader(TensorDataset(torch.randint(1, 32, (8, 6), generator=torch.Generator().manual_seed(0))), 4)
    export = callbacks.BestCheckpoint(dirpath=tmp_path / "lm", monitor="val_loss", export_hf=True)
    package.Trainer(max_epochs=2, callbacks=[export], default_root_dir=tmp_path, **options).fit(hf_module, ids, ids)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "lm" / "best")  # written at each new best
    assert exported.config.vocab_size == 32 and export.best_model_path


def test_the_safe_loader_runs_nothing_it_was_not_allowed_to(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple:
            return (Path.touch, (marker,))  # code a malicious checkpoint would run on a plain torch.load

    checkpoint = {"state_dict": {"w": torch.arange(3.0)}, "hyper_parameters": {"payload": Payload(), **HPARAMS}}
    torch.save(checkpoint, tmp_path / "x.ckpt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "x.ckpt", weights_only=True)
    loaded = load_checkpoint(tmp_path / "x.ckpt")
    assert not marker.exists() and torch.equal(loaded["state_dict"]["w"], torch.arange(3.0))
    hparams = loaded["hyper_parameters"]
    assert isinstance(hparams["payload"], Unloaded) and "touch" in repr(hparams["payload"])
    assert "PosixPath" in repr(hparams["data_dir"]) and hparams["data_dir"].args == ("data", "train")
    assert isinstance(hparams["scheduler"], Unloaded)
