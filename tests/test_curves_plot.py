"""CurvesPlot: curves.png in the run folder at the end of fit, with the panels the logged metrics call for."""

from __future__ import annotations

import csv
import importlib.util
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from helpers.data import regression_data
from lit_trainer.callbacks import CurvesPlot
from lit_trainer.callbacks.curves import (
    MAX_LINES,
    curve_panels,
    draw_curves,
    parse_metric_name,
    read_metrics_csv,
    why_nothing_to_draw,
)

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


# ---------------------------------------------------------------------------------------------------------------
# Projects written elsewhere: their own metric names, grouped into one panel per metric family


def _package(name: str):
    """The Lightning package ``name`` and the CurvesPlot class for its trainers."""
    if name == "pytorch_lightning":
        pl = pytest.importorskip("pytorch_lightning")
        from lit_trainer.callbacks.pytorch_lightning import CurvesPlot as PLCurvesPlot

        return pl, PLCurvesPlot
    return L, CurvesPlot


def _slash_names_module(base: type) -> L.LightningModule:
    """The hydra template's names on ``base`` (a LightningModule class of either package): ``train/loss`` every
    step; ``val/loss``, ``val/acc`` and the best accuracy so far ``val/acc_best`` at each validation."""

    class SlashNames(base):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.best = 0.0

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            error = self.net(batch[0]) - batch[1]
            self.log("val/loss", error.pow(2).mean())
            self.log("val/acc", (error.abs() < 1.0).float().mean())

        def on_validation_epoch_end(self):
            self.best = max(self.best, float(self.trainer.callback_metrics["val/acc"]))
            self.log("val/acc_best", self.best)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return SlashNames()


class GAN(L.LightningModule):
    """A GAN with manual optimization, as in Lightning's GAN example: ``g_loss`` and ``d_loss`` every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = torch.nn.Linear(2, 4)
        self.discriminator = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        g_opt, d_opt = self.optimizers()
        real = batch[0]
        fake = self.generator(torch.randn(real.shape[0], 2))
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        g_loss = bce(self.discriminator(fake), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())]


class StepAndEpoch(L.LightningModule):
    """Logs ``train_loss`` and ``val_loss`` with ``on_step=True, on_epoch=True`` (Lightning writes ``*_step`` and
    ``*_epoch`` columns), ``nll`` every step and ``matthews_correlation`` at each validation."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("nll", 0.5 * loss + 0.9189)  # a unit-variance Gaussian's negative log-likelihood
        return loss

    def validation_step(self, batch, batch_idx):
        prediction, target = self.net(batch[0]), batch[1]
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, target), on_step=True, on_epoch=True)
        agree = (prediction > 0) == (target > 0)
        self.log("matthews_correlation", 2 * agree.float().mean() - 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(trainer_cls, module, logger, plot, steps: int = 6, **kw) -> None:
    """Fit ``module`` for ``steps`` steps with ``plot``, validating when ``val_check_interval`` is given."""
    base = dict(log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = trainer_cls(max_steps=steps, logger=logger, callbacks=[plot], num_sanity_val_steps=0, **{**base, **kw})
    data = regression_data(0)
    val = DataLoader(data, batch_size=8) if kw.get("val_check_interval") else None
    trainer.fit(module, DataLoader(data, batch_size=4), val)


@dataclass
class Drawn:
    """What the pictures saved during a test hold: their panels ``[(title, [line labels]), ...]`` and the line
    under the grid (``""`` when every panel was drawn), one entry per picture."""

    panels: list[list[tuple[str, list[str]]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@pytest.fixture
def drawn(monkeypatch) -> Drawn:
    import matplotlib.figure

    record = Drawn()
    original = matplotlib.figure.Figure.savefig

    def savefig(self, *args, **kwargs):
        axes = [ax for ax in self.axes if ax.get_visible()]
        record.panels.append([(ax.get_title(), [line.get_label() for line in ax.get_lines()]) for ax in axes])
        record.notes.append(self.get_supxlabel())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return record


def test_slash_names_are_grouped_by_metric_across_splits():
    columns = ["epoch", "step", "train/acc", "train/loss", "val/acc", "val/acc_best", "val/loss"]  # CSV order
    assert [(p.title, p.keys) for p in curve_panels(columns)] == [
        ("loss", ("train/loss", "val/loss")),
        ("acc", ("train/acc", "val/acc", "val/acc_best")),
    ]
    tensorboard_style = ["loss/train", "loss/val", "acc/val", "lr-AdamW", "lr"]
    assert [(p.title, p.keys) for p in curve_panels(tensorboard_style)] == [
        ("loss", ("loss/train", "loss/val")),
        ("learning rate", ("lr", "lr-AdamW")),
        ("acc/val", ("acc/val",)),  # one split only: the title keeps it
    ]


def test_gan_losses_get_one_panel_each():
    assert [(p.title, p.keys) for p in curve_panels(["d_loss", "epoch", "g_loss", "step"])] == [
        ("d_loss", ("d_loss",)),
        ("g_loss", ("g_loss",)),
    ]


def test_step_and_epoch_columns_are_one_metric_and_per_batch_validation_values_are_skipped():
    columns = ["epoch", "matthews_correlation", "nll", "step", "train_loss_epoch", "train_loss_step"]
    columns += ["val_loss_epoch", "val_loss_step", "time_per_step"]
    assert [(p.title, p.keys) for p in curve_panels(columns)] == [
        ("loss", ("train_loss_step", "train_loss_epoch", "val_loss_epoch")),  # val_loss_step: the val batch counter
        ("matthews_correlation", ("matthews_correlation",)),
        ("nll", ("nll",)),
        ("time_per_step", ("time_per_step",)),  # no `time_per_epoch` twin: its own name
    ]
    metric = parse_metric_name("train/acc_epoch", ["train/acc_step", "train/acc_epoch"])
    assert (metric.base, metric.split, metric.granularity) == ("acc", "train", "epoch")


def test_a_crowded_family_draws_its_first_lines_and_names_the_rest():
    columns = [f"grad_2.0_norm/layer{i}" for i in range(MAX_LINES + 3)]
    (panel,) = curve_panels(columns)
    assert panel.title == "grad_2.0_norm"
    assert panel.keys == tuple(columns[:MAX_LINES]) and panel.left_out == tuple(columns[MAX_LINES:])


def test_many_metrics_are_capped_and_the_left_out_panels_are_named(tmp_path, drawn):
    series = {f"metric_{i:02d}": [(0, 1.0), (1, float(i))] for i in range(15)}
    titles = draw_curves(series, tmp_path / "c.png", max_panels=12)
    assert titles == [f"metric_{i:02d}" for i in range(12)]
    assert [title for title, _ in drawn.panels[0]] == titles
    assert drawn.notes == ["3 more panel(s) not drawn: metric_12, metric_13, metric_14"]
    with pytest.raises(ValueError, match=r"max_panels=0 must be a whole number >= 1"):
        CurvesPlot(max_panels=0)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_fit_draws_a_slash_named_project_under_either_package(tmp_path, drawn, package):
    pkg, plot_class = _package(package)
    plot = plot_class()
    logger = pkg.loggers.CSVLogger(tmp_path, name="run")
    _fit(pkg.Trainer, _slash_names_module(pkg.LightningModule), logger, plot, val_check_interval=3)
    assert plot.path == str(tmp_path / "run" / "version_0" / "curves.png")
    assert Path(plot.path).read_bytes().startswith(PNG_MAGIC)
    assert plot.panels == ["loss", "val/acc"]
    assert drawn.panels == [[("loss", ["train/loss", "val/loss"]), ("val/acc", ["val/acc", "val/acc_best"])]]


def test_fit_draws_a_gan_with_manual_optimization(tmp_path, drawn):
    plot = CurvesPlot()
    _fit(L.Trainer, GAN(), CSVLogger(tmp_path, name="gan"), plot, steps=8)
    assert plot.panels == ["d_loss", "g_loss"] and Path(plot.path).is_file()
    assert drawn.panels == [[("d_loss", ["d_loss"]), ("g_loss", ["g_loss"])]] and drawn.notes == [""]
    capped = CurvesPlot(max_panels=1)
    _fit(L.Trainer, GAN(), CSVLogger(tmp_path, name="capped"), capped, steps=4)
    assert (capped.panels, capped.left_out) == (["d_loss"], ["g_loss"])
    assert drawn.notes[1] == "1 more panel(s) not drawn: g_loss"


def test_fit_draws_step_and_epoch_metrics_in_one_panel(tmp_path, drawn):
    plot = CurvesPlot()
    _fit(L.Trainer, StepAndEpoch(), CSVLogger(tmp_path, name="run"), plot, val_check_interval=3)
    assert plot.panels == ["loss", "nll", "matthews_correlation"] and Path(plot.path).is_file()  # first logged first
    assert drawn.panels[0][0] == ("loss", ["train_loss_step", "train_loss_epoch", "val_loss_epoch"])


def _curves_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "CurvesPlot" in str(w.message)]


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_without_a_csv_logger_one_warning_names_what_was_logged(tmp_path, package):
    pkg, plot_class = _package(package)
    plot = plot_class()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the same callback in a second fit: still one warning
            _fit(pkg.Trainer, _slash_names_module(pkg.LightningModule), False, plot, steps=2, default_root_dir=tmp_path)
    (message,) = _curves_warnings(caught)
    assert "CurvesPlot: no curves.png: the run logged train/loss but has no CSV logger" in message
    assert f"(loggers: none); add one: Trainer(logger=[{package}.loggers.CSVLogger('logs'), ...])" in message
    assert "\n" not in message and plot.path is None and not list(tmp_path.rglob("*.png"))


def test_a_run_too_short_to_log_says_why_nothing_is_drawn(tmp_path):
    plot = CurvesPlot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(L.Trainer, GAN(), CSVLogger(tmp_path, name="run"), plot, steps=4, log_every_n_steps=50)
    (message,) = _curves_warnings(caught)
    assert "no row reached" in message and "metrics.csv (the run logged d_loss, g_loss)" in message
    assert "Trainer(log_every_n_steps=50) is more than the run's 4 steps" in message
    assert plot.path is None and not list(tmp_path.rglob("*.png"))


def test_a_metrics_file_with_nothing_numeric_says_which_columns_and_why(tmp_path):
    path = tmp_path / "metrics.csv"
    _write_csv(path, [{"step": 0, "epoch": 0, "note": "warmup", "grad_norm": 1.0}])
    series = read_metrics_csv(path)
    with open(path, newline="") as file:
        columns = next(csv.reader(file))
    assert draw_curves(series, tmp_path / "c.png") == [] and not (tmp_path / "c.png").exists()
    assert why_nothing_to_draw(columns, series) == (
        "it holds only epoch, step (bookkeeping), "
        "grad_norm (left out by exclude=('grad_norm', 'tokens_per_sec', 'padding_fraction', 'cost_spread'); "
        "CurvesPlot(exclude=()) draws them), "
        "note (no numeric value)"
    )
    assert why_nothing_to_draw(["step", "val_acc_epoch", "val_acc_step"], {"val_acc_step": [(0, 1.0)]}) == (
        "it holds only step (bookkeeping), val_acc_epoch (no numeric value), "
        "val_acc_step (per-batch validation values, logged against the batch counter, not the training step)"
    )
    assert why_nothing_to_draw([], {}) == "it is empty: nothing was logged"
    assert [p.title for p in curve_panels(["grad_norm", "tokens_per_sec"], exclude=())] == [
        "grad_norm",
        "tokens_per_sec",
    ]
