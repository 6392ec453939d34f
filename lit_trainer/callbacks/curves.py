"""CurvesPlot: the run's training and validation curves as one picture, ``curves.png`` in the run folder.

Someone who runs one job from a terminal looks at a picture before opening a dashboard. At the end of ``fit`` the
metrics the run logged (the CSV logger's ``metrics.csv``, every part of a resumed run included) are drawn as a grid
of small panels, one per metric family: the same metric at training, validation and test (``train/loss``,
``val/loss``, ``val_loss``, ``loss/val``) and at step and epoch granularity (``train_loss_step``,
``train_loss_epoch``) shares a panel. lit_trainer's own metrics keep their panels (loss, learning rate, DPO's reward
margins and accuracies, GRPO's reward and KL, every validation metric). matplotlib is a dependency of lit_trainer;
in an environment without it the callback says so in one line and draws nothing. When a run gives nothing to draw,
one warning says why.
"""

from __future__ import annotations

import csv
import fnmatch
import importlib.util
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_trainer.core.lightning_namespace import PackageBound

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], sorted by step, one value per step


@dataclass(frozen=True)
class Panel:
    """One panel of the picture: its title, the metrics drawn in it (validation and epoch ones with markers) and
    those of its family left out to keep the legend readable (more than :data:`MAX_LINES`)."""

    title: str
    keys: tuple[str, ...]
    left_out: tuple[str, ...] = ()


@dataclass(frozen=True)
class MetricName:
    """A logged column read as a metric: ``train_loss_step`` is ``loss`` at the training split, step granularity.

    Attributes:
        column: the column as logged.
        base: the metric without its split and granularity (``loss``, ``rewards/margins``, ``acc_best``).
        split: ``"train"``, ``"val"``, ``"test"``, or ``""`` when the name does not say.
        marker: the split as written, ``(prefix, suffix)``: ``("val_", "")``, ``("train/", "")``, ``("", "/val")``.
        granularity: ``"step"`` or ``"epoch"`` for the columns Lightning suffixes when a metric is logged with both
            ``on_step`` and ``on_epoch``, else ``""``.
    """

    column: str
    base: str
    split: str
    marker: tuple[str, str]
    granularity: str


# The fixed panels, in order: (title, metric bases), whatever the split or granularity they were logged at. A panel
# is drawn when the run logged any of its metrics. Lightning's LearningRateMonitor columns (``lr-AdamW``, ...) join
# the learning-rate panel.
FIXED_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss",)),
    ("learning rate", ("learning_rate", "lr")),
    ("reward margins", ("rewards/margins",)),
    ("reward accuracies", ("rewards/accuracies",)),
    ("chosen / rejected rewards", ("rewards/chosen", "rewards/rejected")),
    ("reward", ("reward",)),
    ("kl", ("kl",)),
)
# Columns that count steps or time rather than measure the model: never drawn
BOOKKEEPING = frozenset(
    {"step", "epoch", "global_step", "trainer/global_step", "batch_idx", "time", "timestamp", "_step", "_runtime"}
)
# lit_trainer's run-health columns (throughput, padding, gradient norm, DDP cost spread): in metrics.csv and the
# trackers, left out of the picture by default (``CurvesPlot(exclude=())`` draws them)
DEFAULT_EXCLUDE: tuple[str, ...] = ("grad_norm", "tokens_per_sec", "padding_fraction", "cost_spread")
MAX_PANELS = 12  # default cap on the panels of one picture; the ones left out are named under it
MAX_LINES = 8  # the most lines one panel draws (a family of per-parameter norms would make the legend unreadable)

# How a name says its split: a prefix (``val_loss``, ``val/loss``) or a suffix (TensorBoard's ``loss/val``)
_SPLIT_WORDS = (
    ("train", "train"),
    ("training", "train"),
    ("val", "val"),
    ("valid", "val"),
    ("validation", "val"),
    ("eval", "val"),
    ("test", "test"),
)
_SPLIT_PREFIXES = tuple((f"{word}{sep}", split) for word, split in _SPLIT_WORDS for sep in ("/", "_"))
_SPLIT_SUFFIXES = tuple((f"/{word}", split) for word, split in _SPLIT_WORDS)
_SPLIT_ORDER = {"train": 0, "": 0, "val": 1, "test": 2}


def parse_metric_name(column: str, columns: Iterable[str] = ()) -> MetricName:
    """Read ``column`` as a metric: its base name, split and granularity.

    The ``_step`` / ``_epoch`` suffix counts as Lightning's granularity only when its twin is among ``columns``
    (Lightning writes both), so a metric named ``time_per_step`` keeps its name.

    Example:
        >>> m = parse_metric_name("train_loss_step", ["train_loss_step", "train_loss_epoch"])
        >>> (m.base, m.split, m.granularity)
        ('loss', 'train', 'step')
    """
    names = set(columns)
    name, granularity = column, ""
    for suffix, twin in (("_step", "_epoch"), ("_epoch", "_step")):
        if column.endswith(suffix) and column[: -len(suffix)] + twin in names:
            name, granularity = column[: -len(suffix)], suffix[1:]
    for prefix, split in _SPLIT_PREFIXES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return MetricName(column, name[len(prefix) :], split, (prefix, ""), granularity)
    for suffix, split in _SPLIT_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return MetricName(column, name[: -len(suffix)], split, ("", suffix), granularity)
    return MetricName(column, name, "", ("", ""), granularity)


def skip_reason(column: str, columns: Iterable[str] = (), exclude: Sequence[str] = DEFAULT_EXCLUDE) -> str | None:
    """Why ``column`` is not drawn (``"bookkeeping"``, ``"excluded"``, ``"per-batch validation"``), or None.

    A validation or test metric logged with ``on_step=True`` (``val_loss_step``) is written against the validation
    batch counter, not the training step, so only its ``_epoch`` twin is drawn.
    """
    if column in BOOKKEEPING:
        return "bookkeeping"
    if any(fnmatch.fnmatchcase(column, pattern) for pattern in exclude):
        return "excluded"
    metric = parse_metric_name(column, columns)
    if metric.granularity == "step" and metric.split in ("val", "test"):
        return "per-batch validation"
    return None


def _fixed_index(base: str) -> tuple[int, int] | None:
    """``(panel, position)`` of ``base`` in :data:`FIXED_PANELS`, or None."""
    for index, (title, bases) in enumerate(FIXED_PANELS):
        if base in bases:
            return index, bases.index(base)
        if title == "learning rate" and base.startswith("lr-"):
            return index, len(bases)
    return None


def curve_panels(columns: Iterable[str], exclude: Sequence[str] = DEFAULT_EXCLUDE) -> list[Panel]:
    """The panels for a run that logged ``columns`` (the numeric ones): the fixed panels it has, then one per
    metric family.

    A metric's family is its name without the split (``train/``, ``val_``, ``/val``, ...) and Lightning's
    ``_step`` / ``_epoch`` suffix, up to its last ``/`` (``val_logps/chosen`` and ``val_logps/rejected`` are the
    family ``logps``); ``X_best`` joins ``X`` (the hydra template's ``val/acc_best``). Every split and granularity of
    a family shares one panel, training first. A panel titled by its family keeps the split in its title when all
    its metrics were logged at one split (``val_exact_match``, ``val/acc``). Fixed panels come first
    (:data:`FIXED_PANELS`), then the families with a validation or test metric, then the others, each in the order
    of ``columns``. Bookkeeping columns (``step``, ``epoch``, ...), the ``exclude`` patterns (``fnmatch``) and
    per-batch validation values are left out (:func:`skip_reason`); a panel draws at most :data:`MAX_LINES` lines.

    Example:
        >>> [p.title for p in curve_panels(["train_loss", "learning_rate", "val_loss", "val_exact_match", "step"])]
        ['loss', 'learning rate', 'val_exact_match']
        >>> [(p.title, p.keys) for p in curve_panels(["train/loss", "val/loss", "val/acc", "val/acc_best"])]
        [('loss', ('train/loss', 'val/loss')), ('val/acc', ('val/acc', 'val/acc_best'))]
    """
    present = list(dict.fromkeys(columns))
    metrics = [parse_metric_name(c, present) for c in present if skip_reason(c, present, exclude) is None]
    bases = {m.base for m in metrics}
    fixed: dict[int, list[tuple[tuple[int, int, int, int], str]]] = {}
    families: dict[str, list[tuple[tuple[int, int, int, int], MetricName]]] = {}
    for position, metric in enumerate(metrics):
        base = metric.base
        if base.endswith("_best") and base[: -len("_best")] in bases:
            base = base[: -len("_best")]
        order = (_SPLIT_ORDER[metric.split], metric.granularity == "epoch")
        where = _fixed_index(base)
        if where is not None:
            fixed.setdefault(where[0], []).append(((*order, where[1], position), metric.column))
        else:
            family = base.rsplit("/", 1)[0] if "/" in base else base
            families.setdefault(family, []).append(((*order, 0, position), metric))
    panels = [_panel(FIXED_PANELS[index][0], [column for _, column in sorted(fixed[index])]) for index in sorted(fixed)]
    general: list[tuple[bool, Panel]] = []
    for family, members in families.items():
        members.sort(key=lambda item: item[0])
        markers = {m.marker for _, m in members}
        prefix, suffix = markers.pop() if len(markers) == 1 else ("", "")
        training_only = all(m.split not in ("val", "test") for _, m in members)
        general.append((training_only, _panel(f"{prefix}{family}{suffix}", [m.column for _, m in members])))
    return panels + [panel for _, panel in sorted(general, key=lambda item: item[0])]  # stable: column order kept


def _panel(title: str, keys: list[str]) -> Panel:
    return Panel(title, tuple(keys[:MAX_LINES]), tuple(keys[MAX_LINES:]))


def drawable_columns(series: Mapping[str, Sequence[tuple[int, float]]]) -> list[str]:
    """The metrics of ``series`` with at least one finite value."""
    return [key for key, points in series.items() if any(math.isfinite(value) for _, value in points)]


def metrics_columns(path: str | os.PathLike) -> list[str]:
    """The header of a ``metrics.csv`` (``[]`` for an empty file)."""
    with open(path, newline="") as file:
        return next(csv.reader(file), [])


def read_metrics_csv(path: str | os.PathLike) -> Series:
    """Each numeric column of a Lightning ``metrics.csv`` as ``[(step, value)]`` sorted by step.

    A step logged twice (the rows an interrupted run wrote after its last checkpoint, then the resumed run's rows
    for the same steps) keeps its last value: the resumed run's. Values that are not numbers are skipped.
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
                except (TypeError, ValueError):
                    continue
    return {key: sorted(by_step.items()) for key, by_step in values.items()}


def why_nothing_to_draw(
    columns: Sequence[str], series: Mapping[str, Sequence[tuple[int, float]]], exclude: Sequence[str] = DEFAULT_EXCLUDE
) -> str:
    """Why a ``metrics.csv`` with the header ``columns`` and the numeric ``series`` gives no panel, in one line.

    Example:
        >>> why_nothing_to_draw(["epoch", "note", "step"], {})
        'it holds only epoch, step (bookkeeping), note (no numeric value)'
    """
    if not columns:
        return "it is empty: nothing was logged"
    numeric = set(drawable_columns(series))
    reasons: dict[str, list[str]] = {}
    for column in columns:
        reason = skip_reason(column, columns, exclude) or ("no numeric value" if column not in numeric else None)
        if reason == "excluded":
            reason = f"left out by exclude={tuple(exclude)!r}; CurvesPlot(exclude=()) draws them"
        elif reason == "per-batch validation":
            reason = "per-batch validation values, logged against the batch counter, not the training step"
        reasons.setdefault(reason or "drawable", []).append(column)
    return "it holds only " + ", ".join(f"{_names(cols)} ({reason})" for reason, cols in reasons.items())


def _names(names: Sequence[str], limit: int = 8) -> str:
    """``a, b, c`` (at most ``limit`` names, then ``+N more``)."""
    shown = ", ".join(names[:limit])
    return shown + (f" +{len(names) - limit} more" if len(names) > limit else "")


def draw_curves(
    series: Mapping[str, Sequence[tuple[int, float]]],
    path: str | os.PathLike,
    title: str = "",
    *,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    max_panels: int = MAX_PANELS,
) -> list[str]:
    """Draw the panels of :func:`curve_panels` for ``series`` into the PNG ``path``; returns the panel titles drawn.

    At most ``max_panels`` panels are drawn, in :func:`curve_panels`' order; the titles of the others are written
    under the grid. Uses matplotlib's Agg canvas directly (no ``pyplot``, no change to the global backend). Nothing
    is written when no panel applies.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = drawable_columns(series)
    every = curve_panels(columns, exclude)
    panels, left_out = every[:max_panels], every[max_panels:]
    if not panels:
        return []
    ncols = min(3 if len(panels) <= 9 else 4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    figure = Figure(figsize=(4.2 * ncols, 3.0 * nrows + (0.3 if left_out else 0.0)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    steps_drawn = [step for panel in panels for key in panel.keys for step, _ in series[key]]
    low, high = min(steps_drawn), max(steps_drawn)
    pad = 0.03 * (high - low) or 0.5
    for ax, panel in zip(axes, panels, strict=False):
        for key in panel.keys:
            steps, ys = zip(*series[key], strict=True)
            metric = parse_metric_name(key, columns)
            if metric.split in ("val", "test"):
                style: dict[str, Any] = {"marker": "o", "markersize": 3}
            elif metric.granularity == "epoch" or len(steps) == 1:
                style = {"marker": "s", "markersize": 3, "linewidth": 1.0}
            else:
                style = {"linewidth": 1.2}
            ax.plot(steps, ys, label=key, **style)
        more = f" (+{len(panel.left_out)} not drawn)" if panel.left_out else ""
        ax.set_title(panel.title + more)
        ax.set_xlim(low - pad, high + pad)  # one step axis for every panel, a lone validation point included
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(panel.keys) > 1:
            ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    if left_out:
        figure.supxlabel(
            f"{len(left_out)} more panel(s) not drawn: {_names([p.title for p in left_out])}", fontsize="small"
        )
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
    def __init__(
        self, filename: str = "curves.png", exclude: Sequence[str] = DEFAULT_EXCLUDE, max_panels: int = MAX_PANELS
    ) -> None:
        if not filename.endswith(".png"):
            raise ValueError(f"CurvesPlot: filename={filename!r} must end with .png (e.g. 'curves.png').")
        if isinstance(max_panels, bool) or not isinstance(max_panels, int) or max_panels < 1:
            raise ValueError(f"CurvesPlot: max_panels={max_panels!r} must be a whole number >= 1 (e.g. 12).")
        self.filename = filename
        self.exclude: tuple[str, ...] = (exclude,) if isinstance(exclude, str) else tuple(exclude)
        self.max_panels = max_panels
        self.path: str | None = None
        self.panels: list[str] = []
        self.left_out: list[str] = []
        self._warned = False

    def _nothing_drawn(self, why: str) -> None:
        """Say once (per callback) why this run has no picture."""
        if not self._warned:
            self._warned = True
            self._ns.rank_zero_warn(f"CurvesPlot: no {self.filename}: {why}")

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero:
            return
        self.path, self.panels, self.left_out = None, [], []
        info = self._ns.rank_zero_info
        if importlib.util.find_spec("matplotlib") is None:
            info("[lit_trainer] CurvesPlot: matplotlib is not installed, so no curves.png (pip install matplotlib)")
            return
        logged = _names(sorted(set(trainer.callback_metrics) | set(trainer.logged_metrics)))
        found = _metrics_file(trainer)
        if found is None:
            loggers = ", ".join(type(logger).__name__ for logger in trainer.loggers) or "none"
            self._nothing_drawn(
                f"the run logged {logged or 'no metric'} but has no CSV logger, and the picture is drawn from a CSV "
                f"logger's metrics.csv (loggers: {loggers}); add one: "
                f"Trainer(logger=[{self._ns.package}.loggers.CSVLogger('logs'), ...])."
            )
            return
        logger, metrics_file = found
        logger.save()  # rows still buffered by the CSV logger
        if not os.path.isfile(metrics_file):
            every = trainer.log_every_n_steps
            hint = (
                f"; Trainer(log_every_n_steps={every}) is more than the run's {trainer.global_step} steps, so no "
                "step was logged: lower it"
                if trainer.global_step < every
                else "; log metrics with self.log(...) in the LightningModule"
            )
            self._nothing_drawn(f"no row reached {metrics_file} (the run logged {logged or 'no metric'}){hint}.")
            return
        series = read_metrics_csv(metrics_file)
        path = os.path.join(os.path.dirname(metrics_file), self.filename)
        titles = [panel.title for panel in curve_panels(drawable_columns(series), self.exclude)]
        self.panels = draw_curves(
            series, path, title=os.path.dirname(metrics_file), exclude=self.exclude, max_panels=self.max_panels
        )
        if not self.panels:
            columns = metrics_columns(metrics_file)
            self._nothing_drawn(
                f"{metrics_file} has nothing to draw: {why_nothing_to_draw(columns, series, self.exclude)}."
            )
            return
        self.path = path
        self.left_out = titles[len(self.panels) :]
        more = f" ({len(self.left_out)} more panel(s) not drawn: {_names(self.left_out)})" if self.left_out else ""
        info(f"[lit_trainer] curves: {path}{more}")


class CurvesPlot(_CurvesPlot, Callback):
    """Write the run's curves to ``<run folder>/curves.png`` when ``fit`` ends (global rank 0 only).

    Reads the metrics the run logged from the first CSV logger's ``metrics.csv`` (``lit-trainer`` always has one;
    a resumed run's file holds every part) and draws one panel per metric family over the logged steps: the loss
    (training line, validation markers), the learning rate, DPO's reward margins, accuracies and chosen/rejected
    rewards, GRPO's reward and KL, then every other metric the module logged. A metric's splits and granularities
    share its panel: ``train/loss`` and ``val/loss``, ``train_loss_step`` and ``train_loss_epoch``, ``val/acc`` and
    ``val/acc_best`` (the rule: :func:`curve_panels`). Bookkeeping columns (``step``, ``epoch``), values that are not
    numbers and per-batch validation values are not drawn. Works with any LightningModule; ``lit-trainer`` adds it
    to every run.

    Needs matplotlib (a dependency of lit_trainer); without it one info line is printed and nothing is drawn. When
    nothing can be drawn (no CSV logger, no row logged, no numeric metric), one warning says why and what was logged.

    Args:
        filename: the picture's file name in the run folder.
        exclude: ``fnmatch`` patterns of columns not to draw; the default leaves out lit_trainer's run-health columns
            (:data:`DEFAULT_EXCLUDE`: throughput, padding, gradient norm), ``()`` draws them too.
        max_panels: the most panels one picture holds; the titles of the others are written under the grid and in
            the log line.

    Attributes:
        path: the picture written by the last ``fit`` (``None`` before one, or when it drew nothing).
        panels: the titles of the panels it drew, in order.
        left_out: the titles of the panels over ``max_panels``, not drawn.

    Raises:
        ValueError: ``filename`` does not end with ``.png``, or ``max_panels`` is not a whole number >= 1.

    Example::

        trainer = Trainer(callbacks=[CurvesPlot()], logger=CSVLogger("runs"), max_steps=200)
        trainer.fit(module, datamodule=dm)  # runs/lightning_logs/version_0/curves.png
    """
