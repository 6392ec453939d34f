"""What ``lit-trainer`` prints while and after it trains: a progress bar or plain lines, and a final metrics table.

* :class:`RunProgressBar`: Lightning's ``RichProgressBar``, counting optimizer steps toward ``max_steps`` when it is
  set (Lightning counts micro-batches of the epoch: ``6/3`` for 3 steps of 2 accumulated micro-batches), without the
  ``Epoch 0/-2`` of a step-bounded run, and stopped when training ends, so what is printed after it (the export, the
  final metrics) is not interleaved with redraws of the bar;
* :class:`LineProgressBar`: when stdout is not a terminal (a log file, a batch job) a bar prints nothing useful, so
  one plain line every ``every_n_steps`` optimizer steps and one after each validation instead;
* :class:`FinalMetrics`: the last validation's metrics as a table when ``fit`` ends, and the run folder; the table
  fits the terminal's width (a long metric name is folded onto the next line, the value stays on its row).
"""

from __future__ import annotations

import io
import shutil
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from typing_extensions import override


def _fmt(value: Any) -> str:
    value = value.item() if hasattr(value, "item") else value
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_metrics(metrics: dict[str, Any]) -> str:
    """``key value`` pairs on one line, floats with 4 significant digits.

    Example:
        >>> format_metrics({"train_loss": 1.23456, "v_num": 0})
        'train_loss 1.235 | v_num 0'
    """
    return " | ".join(f"{key} {_fmt(value)}" for key, value in metrics.items())


def metrics_table(metrics: dict[str, Any]) -> Padding:
    """One ``key  value`` row per metric, sorted, keys aligned, indented by two: a Rich renderable that fits the width
    it is rendered at (a name too long for it is folded onto the next lines; values are never cut)."""
    table = Table.grid(padding=(0, 2))
    table.add_column("metric", overflow="fold")
    table.add_column("value", no_wrap=True)
    for key, value in sorted(metrics.items()):
        table.add_row(Text(key), Text(_fmt(value)))  # Text: a name is never read as Rich markup
    return Padding(table, (0, 0, 0, 2))


def render_text(renderable: Any, width: int | None = None) -> str:
    """``renderable`` as plain text (no colours or control codes) ``width`` columns wide (default: the terminal's,
    80 when there is none), without trailing spaces."""
    width = width or shutil.get_terminal_size().columns
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False, emoji=False)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


class RunProgressBar(RichProgressBar):
    """``RichProgressBar`` for step-bounded runs: with ``max_steps`` set the bar counts optimizer steps (resumed runs
    start at the step they resume from) rather than the epoch's micro-batches; it writes ``Epoch 3`` rather than
    ``Epoch 3/-2``, shows its metrics with 4 significant digits and without ``v_num``, and stops its live display
    when training ends (Lightning stops it after ``on_fit_end``, so the lines printed there would be interleaved
    with redraws of the bar)."""

    def _counts_steps(self) -> bool:
        return bool(self.trainer.max_steps and self.trainer.max_steps > 0)

    @property
    @override
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._counts_steps() else super().total_train_batches

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._counts_steps():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:  # a resume in the middle of an epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module).items()
        return {k: _fmt(v) for k, v in metrics if k != "v_num"}  # 4 significant digits: tok/s 2543, not 2542.640

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._update_metrics(trainer, pl_module)
        self._stop_progress()

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 1:
            description = description.replace(f"/{(self.trainer.max_epochs or 0) - 1}", "")
        return description


class LineProgressBar(ProgressBar):
    """Plain-text progress: ``step 100/1500 | epoch 0 | loss 1.23 | tok/s 7012 | 12.3 s`` every ``every_n_steps``.

    A line holds what the progress bar would show (``get_metrics``, without ``v_num``) and the time since the start.

    Args:
        every_n_steps: optimizer steps between lines; ``None`` uses ``trainer.log_every_n_steps``.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._start = time.monotonic()
        self._last_step = -1
        self._pending: int | None = None  # the epoch of a line to print at the next hook

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._last_step = time.monotonic(), trainer.global_step

    def _line(self, trainer: pl.Trainer, metrics: dict[str, Any], prefix: str, epoch: int | None = None) -> str:
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        epoch = trainer.current_epoch if epoch is None else epoch
        parts = [f"{prefix}step {trainer.global_step}{total}", f"epoch {epoch}"]
        if metrics:
            parts.append(format_metrics(metrics))
        parts.append(f"{time.monotonic() - self._start:.1f} s")
        return " | ".join(parts)

    @override
    @rank_zero_only
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps or 50
        if not self._enabled or step == self._last_step:
            return
        self._last_step = step
        if step % every == 0 or step == trainer.max_steps:
            # Lightning calls the callbacks' hook before the module's, where the step's window is logged: print the
            # line at the next hook, so that it shows this step's values and not the previous window's
            self._pending = trainer.current_epoch  # the epoch counter moves on when the run stops

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None and self._enabled:
            metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}  # as the bar
            print(self._line(trainer, metrics, "", self._pending), flush=True)
        self._pending = None

    @override
    @rank_zero_only
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._flush(trainer, pl_module)

    @override
    @rank_zero_only
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)

    @override
    @rank_zero_only
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)

    @override
    @rank_zero_only
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._enabled and not trainer.sanity_checking:
            val = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")}
            print(self._line(trainer, val, "validation at "), flush=True)


def default_progress_bar() -> ProgressBar:
    """A Rich bar on a terminal, plain lines otherwise (output redirected to a file or a pipe)."""
    return RunProgressBar() if sys.stdout.isatty() else LineProgressBar()


class FinalMetrics(Callback):
    """Print the last validation's metrics (``val*`` keys) and the run folder when ``fit`` ends."""

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}
        self.step: int | None = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")}
            self.step = trainer.global_step

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = trainer.log_dir  # a collective: every rank asks
        if not trainer.is_global_zero:
            return
        if self.metrics:
            table = render_text(metrics_table(self.metrics))
            print(f"\nFinal validation metrics (step {self.step}):\n{table}", flush=True)
        else:
            print("\nNo validation ran during fit (see trainer.val_check_interval / limit_val_batches).", flush=True)
        print(f"Run folder: {log_dir}", flush=True)
