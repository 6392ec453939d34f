"""CurvesPlot: the run's training and validation curves as one picture, ``curves.png`` in the run folder.

Someone who runs one job from a terminal looks at a picture before opening a dashboard. At the end of ``fit`` the
metrics the run logged (the CSV logger's ``metrics.csv``, every part of a resumed run included) are drawn as a grid
of small panels: the loss, the learning rate, DPO's reward margins and accuracies, GRPO's reward and KL, and every
validation metric at the steps it was measured. matplotlib is a dependency of lit_trainer; in an environment without
it the callback says so in one line and draws nothing.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_trainer.callbacks._namespace import PackageBound

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], sorted by step, one value per step


@dataclass(frozen=True)
class Panel:
    """One panel of the picture: its title and the metrics drawn in it (validation ones with markers)."""

    title: str
    keys: tuple[str, ...]


# The fixed panels, in order: (title, metrics). A panel is drawn when the run logged any of its metrics.
FIXED_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("train_loss", "loss", "val_loss")),
    ("learning rate", ("learning_rate",)),
    ("reward margins", ("rewards/margins", "val_rewards/margins")),
    ("reward accuracies", ("rewards/accuracies", "val_rewards/accuracies")),
    ("chosen / rejected rewards", ("rewards/chosen", "rewards/rejected", "val_rewards/chosen", "val_rewards/rejected")),
    ("reward", ("reward", "val_reward")),
    ("kl", ("kl", "val_kl")),
)


def curve_panels(columns: Iterable[str]) -> list[Panel]:
    """The panels for a run that logged ``columns``: the fixed ones it has, then one per validation metric group.

    Learning-rate columns of Lightning's ``LearningRateMonitor`` (``lr-AdamW``, ...) join the learning-rate panel.
    Validation metrics (``val_*``) not in a fixed panel are grouped by the part of their name before the last
    ``/``: ``val_logps/chosen`` and ``val_logps/rejected`` share a panel ``val_logps``.

    Example:
        >>> [p.title for p in curve_panels(["train_loss", "learning_rate", "val_loss", "val_exact_match", "step"])]
        ['loss', 'learning rate', 'val_exact_match']
    """
    present = list(dict.fromkeys(columns))
    panels: list[Panel] = []
    used: set[str] = set()
    for title, keys in FIXED_PANELS:
        if title == "learning rate":
            keys = keys + tuple(c for c in present if c.startswith("lr-"))
        have = tuple(k for k in keys if k in present)
        if have:
            panels.append(Panel(title, have))
            used.update(have)
    groups: dict[str, list[str]] = {}
    for column in present:
        if column.startswith("val_") and column not in used:
            groups.setdefault(column.rsplit("/", 1)[0] if "/" in column else column, []).append(column)
    panels += [Panel(title, tuple(keys)) for title, keys in groups.items()]
    return panels


def read_metrics_csv(path: str | os.PathLike) -> Series:
    """Each numeric column of a Lightning ``metrics.csv`` as ``[(step, value)]`` sorted by step.

    A step logged twice (the rows an interrupted run wrote after its last checkpoint, then the resumed run's rows
    for the same steps) keeps its last value: the resumed run's.
    """
    values: dict[str, dict[int, float]] = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            step = row.get("step")
            if not step:
                continue
            for key, text in row.items():
                if key in ("step", "epoch") or not text:
                    continue
                try:
                    values.setdefault(key, {})[int(float(step))] = float(text)
                except ValueError:
                    continue
    return {key: sorted(by_step.items()) for key, by_step in values.items()}


def draw_curves(
    series: Mapping[str, Sequence[tuple[int, float]]], path: str | os.PathLike, title: str = ""
) -> list[str]:
    """Draw the panels of :func:`curve_panels` for ``series`` into the PNG ``path``; returns the panel titles drawn.

    Uses matplotlib's Agg canvas directly (no ``pyplot``, no change to the global backend). Nothing is written when
    no panel applies.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = curve_panels(key for key in series if series[key])
    if not panels:
        return []
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    figure = Figure(figsize=(4.2 * ncols, 3.0 * nrows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    steps_drawn = [step for panel in panels for key in panel.keys for step, _ in series[key]]
    low, high = min(steps_drawn), max(steps_drawn)
    pad = 0.03 * (high - low) or 0.5
    for ax, panel in zip(axes, panels, strict=False):
        for key in panel.keys:
            steps, ys = zip(*series[key], strict=True)
            style = {"marker": "o", "markersize": 3} if key.startswith("val_") else {"linewidth": 1.2}
            ax.plot(steps, ys, label=key, **style)
        ax.set_title(panel.title)
        ax.set_xlim(low - pad, high + pad)  # one step axis for every panel, a lone validation point included
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(panel.keys) > 1:
            ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return [panel.title for panel in panels]


def _metrics_file(trainer: Any) -> tuple[Any, str] | None:
    """The first logger that writes a ``metrics.csv`` (Lightning's ``CSVLogger`` and its subclasses), and the file."""
    for logger in trainer.loggers:
        path = getattr(getattr(logger, "experiment", None), "metrics_file_path", None)
        if isinstance(path, str):
            return logger, path
    return None


class _CurvesPlot(PackageBound):
    def __init__(self, filename: str = "curves.png") -> None:
        if not filename.endswith(".png"):
            raise ValueError(f"CurvesPlot: filename={filename!r} must end with .png (e.g. 'curves.png').")
        self.filename = filename
        self.path: str | None = None
        self.panels: list[str] = []

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero:
            return
        info = self._ns.rank_zero_info
        if importlib.util.find_spec("matplotlib") is None:
            info("[lit_trainer] CurvesPlot: matplotlib is not installed, so no curves.png (pip install matplotlib)")
            return
        found = _metrics_file(trainer)
        if found is None:
            info("[lit_trainer] CurvesPlot: no CSV logger in this run, so no metrics to draw")
            return
        logger, metrics_file = found
        logger.save()  # rows still buffered by the CSV logger
        if not os.path.isfile(metrics_file):
            return
        path = os.path.join(os.path.dirname(metrics_file), self.filename)
        self.panels = draw_curves(read_metrics_csv(metrics_file), path, title=os.path.dirname(metrics_file))
        if self.panels:
            self.path = path
            info(f"[lit_trainer] curves: {path}")


class CurvesPlot(_CurvesPlot, Callback):
    """Write the run's curves to ``<run folder>/curves.png`` when ``fit`` ends (global rank 0 only).

    Reads the metrics the run logged from the first CSV logger's ``metrics.csv`` (``lit-trainer`` always has one;
    a resumed run's file holds every part) and draws one panel each for the loss (training line, validation
    markers), the learning rate, DPO's reward margins, accuracies and chosen/rejected rewards, GRPO's reward and
    KL, and every other validation metric, over the logged steps. A panel appears when its metrics were logged.
    Works with any LightningModule; ``lit-trainer`` adds it to every run.

    Needs matplotlib (a dependency of lit_trainer); without it one info line is printed and nothing is drawn.
    Without a CSV logger, nothing is drawn either.

    Args:
        filename: the picture's file name in the run folder.

    Attributes:
        path: the picture written by the last ``fit`` (``None`` before one).
        panels: the titles of the panels it drew, in order.

    Raises:
        ValueError: ``filename`` does not end with ``.png``.

    Example::

        trainer = Trainer(callbacks=[CurvesPlot()], logger=CSVLogger("runs"), max_steps=200)
        trainer.fit(module, datamodule=dm)  # runs/lightning_logs/version_0/curves.png
    """
