"""TrackioLogger with the real ``trackio`` package, offline: metrics and hyper-parameters land in the local store at
Lightning's steps, tables read back, a run folder's Trackio run is continued (and rewound) on resume, and nothing
reaches for the network."""

from __future__ import annotations

import json
import socket
import sys

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from helpers.data import regression_data
from helpers.trackio_store import config, new_project, rows, runs, steps_of
from lit_trainer.loggers import TrackioLogger
from lit_trainer.loggers.trackio import RECORD_FILE

pytest.importorskip("trackio")


class LoggingRegressor(L.LightningModule):
    """A linear regression that logs ``train_loss`` every step and keeps the values it logged."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.logged.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _fit(logger: TrackioLogger, steps: int) -> LoggingRegressor:
    module = LoggingRegressor()
    trainer = L.Trainer(
        max_steps=steps,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(regression_data(0), batch_size=8))
    return module


def test_metrics_and_hyperparameters_land_in_the_local_store_at_lightnings_steps(tmp_path):
    project = new_project()
    logger = TrackioLogger(project=project, save_dir=tmp_path, name="sft", version=0)
    module = _fit(logger, steps=6)
    (run,) = runs(project)
    assert run["name"] == "sft-version_0"
    record = json.loads((tmp_path / "sft" / "version_0" / RECORD_FILE).read_text())
    assert record == {"project": project, "run_name": "sft-version_0", "run_id": run["id"]}
    logged = [row for row in rows(project, run["id"]) if "train_loss" in row]
    assert [row["step"] for row in logged] == [0, 1, 2, 3, 4, 5]  # Lightning's 0-based optimizer step
    assert [row["train_loss"] for row in logged] == pytest.approx(module.logged, rel=1e-6)
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_run_config(project, run_id=run["id"])["lr"] == 0.05


def test_log_table_reads_back_from_the_store(tmp_path):
    project = new_project()
    logger = TrackioLogger(project=project, save_dir=tmp_path, name="grpo", version=0)
    logger.log_table(key="completions", columns=["prompt", "completion", "reward"], data=[["1+1=", "2", 1.0]], step=7)
    logger.finalize("success")
    (run,) = runs(project)
    (row,) = rows(project, run["id"])
    assert row["step"] == 7
    assert row["completions"]["_type"] == "trackio.table"
    assert row["completions"]["_value"] == [{"prompt": "1+1=", "completion": "2", "reward": 1.0}]


def test_resume_in_the_run_folder_continues_the_run_and_rewinds_to_the_checkpoint(tmp_path):
    project = new_project()
    first = TrackioLogger(project=project, save_dir=tmp_path, name="sft", version=3)
    for step in range(6):  # the interrupted part: its checkpoint was at step 3, it went on to log steps 3..5
        first.log_metrics({"train_loss": float(step)}, step=step)
    first.finalize("failed")
    resumed = TrackioLogger(project=project, save_dir=tmp_path, name="sft", version=3)
    resumed.rewind(3)
    for step in range(3, 8):
        resumed.log_metrics({"train_loss": 100.0 + step}, step=step)
    resumed.finalize("success")
    (run,) = runs(project)  # one run: the same one
    assert run["name"] == "sft-version_3"
    assert steps_of(project, run["id"], "train_loss") == list(range(8))  # every step once
    values = [row["train_loss"] for row in rows(project, run["id"])]
    assert values == [0.0, 1.0, 2.0, 103.0, 104.0, 105.0, 106.0, 107.0]  # the resumed part's values after step 2


def test_a_fresh_run_never_shares_a_name_with_another_run_of_the_project(tmp_path):
    project = new_project()
    for root in ("a", "b"):  # two roots, each with its own runs/sft/version_0
        logger = TrackioLogger(project=project, save_dir=tmp_path / root, name="sft", version=0)
        logger.log_metrics({"x": 1.0}, step=0)
        logger.finalize("success")
    assert sorted(run["name"] for run in runs(project)) == ["sft-version_0", "sft-version_0-2"]


def test_stays_local_with_a_space_configured_and_a_hub_token(tmp_path, monkeypatch):
    """A Space in the environment and a Hugging Face token would make trackio deploy to the Space and ask the Hub
    who the user is; the logger stays on the local store and makes no connection."""
    attempts: list[object] = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError("no network in this test")

    def refuse_lookup(host, *args, **kwargs):
        attempts.append(host)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse_lookup)
    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/some-space")
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    project = new_project()
    logger = TrackioLogger(project=project, save_dir=tmp_path, name="sft", version=0)
    logger.log_metrics({"train_loss": 1.0}, step=0)
    logger.finalize("success")
    assert attempts == []
    (run,) = runs(project)
    assert steps_of(project, run["id"], "train_loss") == [0]


def test_without_trackio_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)
    logger = TrackioLogger(project=new_project())
    with pytest.raises(ModuleNotFoundError, match=r'pip install "lit_trainer\[trackio\]"'):
        logger.log_metrics({"x": 1.0}, step=0)


def test_refuses_an_unknown_resume_mode():
    with pytest.raises(ValueError, match="resume='sometimes'"):
        TrackioLogger(resume="sometimes")


def test_the_pytorch_lightning_twin_logs_from_a_pytorch_lightning_trainer(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from lit_trainer.loggers.pytorch_lightning import TrackioLogger as PLTrackioLogger

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    project = new_project()
    logger = PLTrackioLogger(project=project, save_dir=tmp_path, name="pl", version=0)
    assert isinstance(logger, pl.loggers.Logger) and not isinstance(logger, L.loggers.Logger)
    trainer = pl.Trainer(
        max_steps=3,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(regression_data(0), batch_size=8))
    (run,) = runs(project)
    assert steps_of(project, run["id"], "train_loss") == [0, 1, 2]


HYDRA_PARAMS = {"_target_": "x", "model": {"_target_": "y"}}  # hydra's instantiate keys, top level and nested
TRACKIO_OWN = {"_Username", "_Created", "_Group"}  # the config entries trackio adds itself


def _logged_config(project: str) -> dict:
    (run,) = runs(project)
    return config(project, run["id"])


def test_reserved_hyperparameter_keys_are_renamed_when_logged_outside_fit(tmp_path):
    """trackio refuses config keys that start with `_` when a run starts: `log_hyperparams` then `log_metrics`
    outside a Trainer failed with "Config key '_target_' is reserved"."""
    project = new_project()
    logger = TrackioLogger(project=project, save_dir=tmp_path, name="sft", version=0)
    logger.log_hyperparams(HYDRA_PARAMS)
    logger.log_metrics({"train_loss": 1.0}, step=0)
    logger.finalize("success")
    stored = _logged_config(project)
    assert stored["target_"] == "x" and stored["model/_target_"] == "y"
    assert {key for key in stored if key.startswith("_")} == TRACKIO_OWN


def test_reserved_hyperparameter_keys_are_renamed_the_same_way_inside_fit(tmp_path):
    """Inside `fit` the run has started when Lightning logs the hyper-parameters, so trackio did not check them:
    `_target_` was stored as is (hidden by the dashboard, and next to trackio's own `_` entries)."""

    class HydraModule(LoggingRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters(HYDRA_PARAMS)

    project = new_project()
    logger = TrackioLogger(project=project, save_dir=tmp_path, name="sft", version=0)
    L.Trainer(
        max_steps=2,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(HydraModule(), DataLoader(regression_data(0), batch_size=8))
    stored = _logged_config(project)
    assert stored["target_"] == "x" and stored["model/_target_"] == "y"
    assert {key for key in stored if key.startswith("_")} == TRACKIO_OWN


def test_a_renamed_key_never_overwrites_another_key(tmp_path):
    project = new_project()
    logger = TrackioLogger(project=project, config={"__seed": 3, "seed": 1}, save_dir=tmp_path, name="sft", version=0)
    logger.log_hyperparams({"_target_": "renamed", "target_": "kept"})
    logger.log_hyperparams({"_target_": "again"})  # a second call: the same name as the first time
    logger.log_metrics({"train_loss": 1.0}, step=0)
    logger.finalize("success")
    stored = _logged_config(project)
    assert (stored["target_"], stored["target_-2"]) == ("kept", "again")
    assert (stored["seed"], stored["seed-2"]) == (1, 3)
