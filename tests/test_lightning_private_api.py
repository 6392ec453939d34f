"""Guard: every private Lightning name lit_trainer still uses exists, with the shape lit_trainer expects.

lit_trainer builds on Lightning's public API, except for the names listed here (also listed in docs/lightning.md,
"Compatibility with Lightning"). Private names can change in any Lightning release; the ``lightning>=2.6,<2.7`` pin in
pyproject.toml (``pytorch-lightning>=2.6,<2.7`` for the ``pytorch_lightning`` callbacks) keeps them stable.
When a test here fails after changing that pin, its message names the lit_trainer feature to adapt first.
The last tests pin the order of public ``ModelCheckpoint`` calls that ``BestCheckpoint`` relies on, and that
``BestCheckpoint`` uses no private ``ModelCheckpoint`` name.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["lightning.pytorch", "pytorch_lightning"]  # the callbacks serve both (lit_trainer.core.lightning_namespace)

STEP_BAR = "RunProgressBar counts optimizer steps and stops its display when training ends"
# (feature, module under the package, class, method, parameter names) - methods lit_trainer overrides or calls
METHODS = [
    (
        "RunProgressBar (lit_trainer.callbacks.progress) overrides it",
        "callbacks",
        "RichProgressBar",
        "_get_train_description",
        ["self", "current_epoch"],
    ),
    *[
        (
            "RunProgressBar counts optimizer steps and stops its display when training ends",
            "callbacks",
            "RichProgressBar",
            name,
            params,
        )
        for name, params in (
            ("_update", ["self", "progress_bar_id", "current", "visible", "hard"]),
            ("_initialize_train_progress_bar_id", ["self"]),
            ("_update_metrics", ["self", "trainer", "pl_module"]),
            ("_stop_progress", ["self"]),
        )
    ],
    ("LitTrainerCLI (lit_trainer.cli) overrides it", "cli", "LightningCLI", "_parse_ckpt_path", ["self"]),
    (
        "LitTrainerCLI (lit_trainer.cli) overrides it",
        "cli",
        "LightningCLI",
        "_instantiate_trainer",
        ["self", "config", "callbacks"],
    ),
    (
        "RunCSVLogger (lit_trainer.cli.runs) overrides it to append to metrics.csv",
        "loggers.csv_logs",
        "ExperimentWriter",
        "_check_log_dir_exists",
        ["self"],
    ),
    (
        "BEMA and NEFTune build their state_key with it",
        "callbacks",
        "Callback",
        "_generate_state_key",
        ["self", "kwargs"],
    ),
]
# (feature, dotted path from a fresh Trainer, expected type or None) - what the callbacks read on the trainer
TRAINER_ATTRIBUTES = [
    (
        "EvalOnStart (restores the logger state) and the step logging (lit_trainer.modules.base._step_logging)",
        "_logger_connector",
        None,
    ),
    ("EvalOnStart restores it after its validation pass", "_logger_connector._first_loop_iter", None),
    ("EvalOnStart removes its step-0 metrics from it", "_logger_connector._callback_metrics", dict),
    (
        "the step logging (lit_trainer.modules.base._step_logging) follows log_every_n_steps with it",
        "_logger_connector.should_update_logs",
        bool,
    ),
    (
        "JITCheckpoint writes the saved step's logs through them before it stops",
        "_logger_connector.update_train_step_metrics",
        None,
    ),
    ("JITCheckpoint writes the saved step's logs through them", "_logger_connector.on_batch_end", None),
    (
        "JITCheckpoint corrects the logger step of a checkpoint written inside a batch",
        "fit_loop.epoch_loop._batches_that_stepped",
        int,
    ),
    ("JITCheckpoint reads it for a checkpoint written inside a batch", "fit_loop.epoch_loop._should_accumulate", None),
    (
        "ExactResume (lit_trainer.callbacks.resume) wraps the training loaders in it; JITCheckpoint reads their "
        "positions from it for a checkpoint written inside a batch",
        "fit_loop._combined_loader",
        None,
    ),
    ("ExactResume rebuilds the epoch iterator through it", "fit_loop._data_fetcher", None),
]


def _import(package: str, module: str) -> Any:
    pytest.importorskip(package)
    return importlib.import_module(f"{package}.{module}" if module else package)


def _message(feature: str, name: str, package: str) -> str:
    version = importlib.import_module(package.split(".")[0]).__version__
    return (
        f"{feature}: it relies on the private Lightning name `{name}`, which {package} {version} no longer "
        "provides as expected. lit_trainer pins lightning>=2.6,<2.7 (pyproject.toml) because of it; adapt that "
        "feature before changing the pin."
    )


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize(("feature", "module", "owner", "name", "params"), METHODS)
def test_private_methods_exist_with_their_signature(
    package: str, feature: str, module: str, owner: str, name: str, params: list[str]
) -> None:
    cls = getattr(_import(package, module), owner)
    method = inspect.getattr_static(cls, name, None)
    assert callable(method), _message(feature, f"{owner}.{name}", package)
    assert list(inspect.signature(method).parameters) == params, _message(feature, f"{owner}.{name}{params}", package)


@pytest.mark.parametrize("package", PACKAGES)
def test_private_callback_property_exists(package: str) -> None:
    callback = _import(package, "callbacks").Callback
    feature = "BEMA accepts checkpoints saved under its old state key"
    assert isinstance(inspect.getattr_static(callback, "_legacy_state_key", None), property), _message(
        feature, "Callback._legacy_state_key", package
    )


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize(("feature", "dotted", "kind"), TRAINER_ATTRIBUTES)
def test_private_trainer_attributes_exist(package: str, feature: str, dotted: str, kind: type | None) -> None:
    trainer = _import(package, "").Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    obj: Any = trainer
    for part in dotted.split("."):
        assert hasattr(obj, part), _message(feature, f"trainer.{dotted}", package)
        obj = getattr(obj, part)
    assert kind is None or isinstance(obj, kind), _message(feature, f"trainer.{dotted} ({kind.__name__})", package)


def test_private_logger_attributes_exist(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    feature = "RunCSVLogger (lit_trainer.cli.runs) creates its appending writer through them"
    for name in ("_experiment", "_fs"):
        assert name in vars(logger), _message(feature, f"CSVLogger.{name}", "lightning.pytorch")
    assert callable(getattr(logger._fs, "makedirs", None)), _message(
        feature, "CSVLogger._fs.makedirs", "lightning.pytorch"
    )


def test_private_tensorboard_logger_attributes_exist(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, default_hp_metric=False)
    feature = "rewind_trackers (lit_trainer.cli.app) opens a resumed run's writer with purge_step through them"
    assert logger._experiment is None and isinstance(logger._kwargs, dict), _message(
        feature, "TensorBoardLogger._experiment / _kwargs", "lightning.pytorch"
    )


def test_private_hyperparameter_dicts_exist() -> None:
    class Module(pl.LightningModule):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()

    module = Module()
    feature = "BaseModule.save_hyperparameters (lit_trainer.modules.base) records peft_config in them"
    for name in ("_hparams", "_hparams_initial"):
        assert dict(getattr(module, name, {})) == {"width": 3}, _message(
            feature, f"LightningModule.{name}", "lightning.pytorch"
        )


def test_private_distributed_checkpoint_helpers_exist() -> None:
    load = importlib.import_module("lightning.fabric.utilities.load")
    feature = (
        "BestCheckpoint (load_best_at_end / export_hf) and BEMA.bema_weights_from_checkpoint read "
        "ModelParallelStrategy checkpoint folders with them"
    )
    assert load._METADATA_FILENAME == "meta.pt", _message(feature, "_METADATA_FILENAME", "lightning.fabric")
    params = list(inspect.signature(load._load_distributed_checkpoint).parameters)
    assert params == ["checkpoint_folder"], _message(feature, "_load_distributed_checkpoint", "lightning.fabric")


@pytest.mark.parametrize(
    ("distribution", "package"), [("lightning", "lightning"), ("pytorch-lightning", "pytorch_lightning")]
)
def test_the_pin_matches_the_installed_minor_version(distribution: str, package: str) -> None:
    requirements = re.findall(r'"([a-z-]+)((?:[<>=!~]=?[0-9.]+,?)+)"', (ROOT / "pyproject.toml").read_text())
    (pin,) = {spec for name, spec in requirements if name == distribution}  # the same pin wherever it is listed
    installed = Version(importlib.import_module(pytest.importorskip(package).__name__).__version__)
    assert pin == ">=2.6,<2.7", f"the {distribution} pin changed to {pin!r}: re-check every name in this file"
    assert installed in SpecifierSet(pin), (
        f"{distribution} {installed} is installed, outside the pin {pin}: "
        "the private names listed in this file are only checked for 2.6.x"
    )


# ----------------------------------------------------------------- the public ModelCheckpoint flow BestCheckpoint uses


class _Scripted(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val", 1.0 + self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Rewrites(ModelCheckpoint):
    """Writes 7.0 into the tensor ``check_monitor_top_k`` receives (as BestCheckpoint writes rank 0's value)."""

    def check_monitor_top_k(self, trainer: pl.Trainer, current: torch.Tensor | None = None) -> bool:
        current.copy_(torch.tensor(7.0))
        return True


def test_model_checkpoint_names_and_scores_with_the_tensor_it_asks_about(tmp_path: Path) -> None:
    cb = _Rewrites(dirpath=tmp_path, filename="{val:.1f}", monitor="val", save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=2,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    trainer.fit(_Scripted(), data, data)
    message = (
        "BestCheckpoint (DDP agreement) writes rank 0's score into the tensor check_monitor_top_k receives, "
        "expecting ModelCheckpoint to name the file and record the score from it"
    )
    assert float(cb.best_model_score) == 7.0 and cb.best_model_path.endswith("val=7.0.ckpt"), message
    saved = torch.load(cb.best_model_path, weights_only=True)["callbacks"][cb.state_key]
    message = (
        "BestCheckpoint marks a distributed checkpoint folder as incomplete from on_save_checkpoint, "
        "expecting ModelCheckpoint to set best_model_path to the file before writing it"
    )
    assert saved["best_model_path"] == cb.best_model_path, message


def test_model_checkpoint_saves_only_from_the_hooks_best_checkpoint_wraps() -> None:
    hooks = {name for name in vars(ModelCheckpoint) if name.startswith("on_") or name in ("setup", "teardown")}
    assert hooks == {
        "setup",
        "on_train_start",
        "on_train_batch_end",
        "on_train_epoch_end",
        "on_validation_end",
        "on_exception",
        "on_train_end",
    }, (
        f"ModelCheckpoint now implements the hooks {sorted(hooks)}: BestCheckpoint runs its after-save steps (rank "
        "agreement, export_hf, save_total_limit) after on_train_batch_end, on_train_epoch_end and "
        "on_validation_end only; wrap any new hook that can save"
    )


def test_best_checkpoint_uses_no_private_model_checkpoint_name() -> None:
    from lit_trainer.callbacks.checkpointing.best_checkpoint import _BestCheckpoint

    private = {
        n for n in [*dir(ModelCheckpoint), *vars(ModelCheckpoint())] if n.startswith("_") and not n.startswith("__")
    }
    source = (ROOT / "lit_trainer" / "callbacks" / "checkpointing" / "__init__.py").read_text()
    used = {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}
    overridden = {n for n in vars(_BestCheckpoint) if n in private}
    assert not (used & private) and not overridden, (
        f"BestCheckpoint uses the private ModelCheckpoint names {sorted((used & private) | overridden)}; use "
        "public extension points instead (check_monitor_top_k, the hooks, strategy.checkpoint_io)"
    )
