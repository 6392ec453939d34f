"""``lit-trainer fit --report_to``: tracker names as the HF Trainer's ``report_to``, next to the run's CSV log; a
resumed run continues its Trackio run with each step once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from helpers.cli import CONFIGS, QUIET_FIT
from helpers.trackio_store import new_project, runs, steps_of
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.cli.trackers import parse_report_to, tracker_loggers

MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}


def test_names_are_split_on_commas_and_csv_is_always_on():
    assert parse_report_to("trackio, tensorboard") == ["trackio", "tensorboard"]
    assert parse_report_to("TensorBoard,csv,tensorboard") == ["tensorboard"]
    assert parse_report_to(["trackio"]) == ["trackio"]  # a YAML list
    assert parse_report_to("none") == [] and parse_report_to("csv") == []


def test_all_means_every_installed_tracker():
    expected = [name for name, module in MODULES.items() if importlib.util.find_spec(module) is not None]
    assert parse_report_to("all") == expected


def test_an_unknown_name_lists_the_valid_ones_and_the_closest():
    with pytest.raises(ValueError, match=r"unknown tracker 'trakio'\. Did you mean 'trackio'\?") as error:
        parse_report_to("tensorboard,trakio")
    for name in ("tensorboard", "trackio", "wandb", "mlflow", "csv", "all", "none"):
        assert name in str(error.value)
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        parse_report_to("none,trackio")


def test_a_tracker_that_is_not_installed_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"not installed \(wandb: pip install wandb\)"):
        parse_report_to("trackio,wandb")


def test_the_csv_logger_stays_first_and_loggers_of_your_own_are_kept():
    configured = [
        {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "runs"}},
        {"class_path": "my.pkg.MyLogger", "init_args": {}},
        {"class_path": "lit_trainer.cli.runs.RunCSVLogger", "init_args": {"save_dir": "runs"}},
    ]
    built = tracker_loggers(["trackio"], configured, "runs")
    assert [entry["class_path"] for entry in built] == [
        "lit_trainer.cli.runs.RunCSVLogger",
        "my.pkg.MyLogger",
        "lit_trainer.loggers.TrackioLogger",
    ]
    assert [entry["class_path"] for entry in tracker_loggers([], [], "runs")] == ["lit_trainer.cli.runs.RunCSVLogger"]


@pytest.mark.slow
def test_report_to_trackio_then_resume_continues_the_same_trackio_run_with_each_step_once(tmp_path, monkeypatch):
    pytest.importorskip("trackio")
    monkeypatch.chdir(tmp_path)
    project = new_project()
    monkeypatch.setenv("TRACKIO_PROJECT", project)
    config = yaml.safe_load((CONFIGS / "sft.yaml").read_text())
    (periodic,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("ModelCheckpoint")]
    periodic["init_args"] = {"every_n_train_steps": 2, "save_top_k": -1, "save_last": True}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    args = ["fit", "--config", "sft.yaml", "--trainer.max_steps", "5", *QUIET_FIT, "--trainer.log_every_n_steps", "1"]

    first = LitTrainerCLI(args=[*args, "--report_to", "trackio"])
    assert [type(lg).__name__ for lg in first.trainer.loggers] == ["RunCSVLogger", "TrackioLogger"]
    run_dir = tmp_path / "runs" / "sft" / "version_0"
    assert (run_dir / "curves.png").is_file()
    (run,) = runs(project)
    assert run["name"] == "sft-version_0"
    assert steps_of(project, run["id"], "train_loss") == [0, 1, 2, 3, 4]

    # continue from the step-2 checkpoint on purpose: steps 3..5 are trained (and logged) again
    (step2,) = (run_dir / "checkpoints").glob("*step=2.ckpt")
    resumed = LitTrainerCLI(args=[*args, "--report_to", "trackio", "--ckpt_path", str(step2)])
    assert Path(resumed.trainer.log_dir).resolve() == run_dir.resolve()
    assert runs(project) == [run]  # the same Trackio run
    assert steps_of(project, run["id"], "train_loss") == [0, 1, 2, 3, 4]  # each step once


def test_a_resume_hides_the_tensorboard_events_logged_after_its_checkpoint(tmp_path):
    """After a crash past the last checkpoint, the resumed part logs those steps again: TensorBoard must show each
    step once, as metrics.csv and Trackio do (SummaryWriter's purge_step hides the events at and after it)."""
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_trainer.cli.app import rewind_trackers

    first = TensorBoardLogger(tmp_path, name="run", version=0, default_hp_metric=False)
    for step in range(6):  # the interrupted part: steps 0-5, its last checkpoint at step 3
        first.log_metrics({"train_loss": float(step)}, step=step)
    first.finalize("failed")
    checkpoint = tmp_path / "step3.ckpt"
    torch.save({"lit_trainer_run": {"global_step": 3}}, checkpoint)
    resumed = TensorBoardLogger(tmp_path, name="run", version=0, default_hp_metric=False)
    rewind_trackers([resumed], str(checkpoint))
    for step in range(3, 6):  # the resumed part logs steps 3-5 again
        resumed.log_metrics({"train_loss": 10.0 + step}, step=step)
    resumed.finalize("success")
    events = EventAccumulator(str(tmp_path / "run" / "version_0"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train_loss")]
    assert logged == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)], logged
