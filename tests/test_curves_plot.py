"""CurvesPlot: curves.png in the run folder at the end of fit, with the panels the logged metrics call for."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from helpers.data import regression_data
from lit_trainer.callbacks import CurvesPlot
from lit_trainer.callbacks.curves import curve_panels, draw_curves, read_metrics_csv

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_csv(path, rows: list[dict]) -> None:
    keys = sorted({key for row in rows for key in row})
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


class ValRegressor(L.LightningModule):
    """Logs ``train_loss`` and ``learning_rate`` every step and ``val_loss``, ``val_mae`` at each validation."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log_dict({"train_loss": loss, "learning_rate": 0.05})
        return loss

    def validation_step(self, batch, batch_idx):
        error = self.net(batch[0]) - batch[1]
        self.log_dict({"val_loss": error.pow(2).mean(), "val_mae": error.abs().mean()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_fit_writes_curves_png_in_the_run_folder_with_loss_lr_and_validation_panels(tmp_path):
    plot = CurvesPlot()
    trainer = L.Trainer(
        max_steps=6,
        val_check_interval=3,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[plot],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = regression_data(0)
    trainer.fit(ValRegressor(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=16))
    picture = tmp_path / "run" / "version_0" / "curves.png"
    assert plot.path == str(picture)
    assert picture.read_bytes().startswith(PNG_MAGIC)
    assert plot.panels == ["loss", "learning rate", "val_mae"]  # val_loss is drawn in the loss panel


def test_dpo_and_grpo_metrics_get_their_panels_and_other_validation_metrics_are_grouped():
    dpo = ["train_loss", "learning_rate", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected"]
    dpo += ["val_loss", "val_rewards/margins", "val_logps/chosen", "val_logps/rejected", "grad_norm", "step"]
    assert [(p.title, p.keys) for p in curve_panels(dpo)] == [
        ("loss", ("train_loss", "val_loss")),
        ("learning rate", ("learning_rate",)),
        ("reward margins", ("rewards/margins", "val_rewards/margins")),
        ("reward accuracies", ("rewards/accuracies",)),
        ("chosen / rejected rewards", ("rewards/chosen", "rewards/rejected")),
        ("val_logps", ("val_logps/chosen", "val_logps/rejected")),
    ]
    grpo = ["train_loss", "reward", "kl", "val_reward", "val_rewards/arithmetic_reward/mean", "lr-AdamW"]
    assert [p.title for p in curve_panels(grpo)] == [
        "loss",
        "learning rate",
        "reward",
        "kl",
        "val_rewards/arithmetic_reward",
    ]


def test_the_picture_holds_one_axes_per_panel_with_its_lines(tmp_path, monkeypatch):
    import matplotlib.figure

    saved: list[matplotlib.figure.Figure] = []
    original = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (saved.append(self), original(self, *a, **k))[1]
    )
    series = {"train_loss": [(0, 2.0), (1, 1.0)], "val_loss": [(1, 1.5)], "kl": [(0, 0.1), (1, 0.2)]}
    titles = draw_curves(series, tmp_path / "c.png")
    (figure,) = saved
    visible = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == titles == ["loss", "kl"]
    assert [[line.get_label() for line in ax.get_lines()] for ax in visible] == [["train_loss", "val_loss"], ["kl"]]
    assert list(visible[0].get_lines()[0].get_ydata()) == [2.0, 1.0]


def test_a_step_logged_twice_keeps_the_resumed_runs_value(tmp_path):
    path = tmp_path / "metrics.csv"
    first = [{"step": s, "train_loss": 10.0 + s} for s in range(5)]  # the interrupted part, checkpoint at step 3
    resumed = [{"step": s, "train_loss": 20.0 + s} for s in range(3, 6)]
    _write_csv(path, [*first, *resumed, {"step": 5, "val_loss": 1.0}])
    series = read_metrics_csv(path)
    assert series["train_loss"] == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]
    assert series["val_loss"] == [(5, 1.0)]


def test_without_matplotlib_one_line_and_no_picture(tmp_path, monkeypatch, caplog):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    plot = CurvesPlot()
    trainer = L.Trainer(
        max_steps=2,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[plot],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level("INFO"):
        trainer.fit(ValRegressor(), DataLoader(regression_data(0), batch_size=4))
    assert plot.path is None and not list(tmp_path.rglob("*.png"))
    assert sum("matplotlib is not installed" in r.getMessage() for r in caplog.records) == 1


def test_refuses_a_file_name_that_is_not_png():
    with pytest.raises(ValueError, match=r"filename='curves.svg' must end with .png"):
        CurvesPlot(filename="curves.svg")


def test_the_plain_install_brings_matplotlib_so_every_run_folder_gets_its_picture():
    """The README promises `curves.png` in every run folder after `pip install -e .`; matplotlib was once only in
    extras, so the promise was false for a plain install. The package's own requirements (no extra) must name it."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "matplotlib" for dep in dependencies), dependencies
