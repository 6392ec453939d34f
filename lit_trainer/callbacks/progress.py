"""What ``lit-trainer`` prints while and after it trains: a progress bar or plain lines, and a final metrics table.

* :class:`RunProgressBar`: Lightning's ``RichProgressBar`` without the ``Epoch 0/-2`` of a step-bounded run;
* :class:`LineProgressBar`: when stdout is not a terminal (a log file, a batch job) a bar prints nothing useful, so
  one plain line every ``every_n_steps`` optimizer steps and one after each validation instead;
* :class:`FinalMetrics`: the last validation's metrics as a table when ``fit`` ends, and the run folder.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from lightning.pytorch.utilities import rank_zero_only
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


def metrics_table(metrics: dict[str, Any]) -> str:
    """One ``key  value`` row per metric, keys aligned (empty string for no metrics)."""
    width = max((len(k) for k in metrics), default=0)
    return "\n".join(f"  {key:<{width}}  {_fmt(value)}" for key, value in sorted(metrics.items()))


class RunProgressBar(RichProgressBar):
    """``RichProgressBar`` that writes ``Epoch 3`` rather than ``Epoch 3/-2`` when the run is bounded by steps."""

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
            print(f"\nFinal validation metrics (step {self.step}):\n{metrics_table(self.metrics)}", flush=True)
        else:
            print("\nNo validation ran during fit (see trainer.val_check_interval / limit_val_batches).", flush=True)
        print(f"Run folder: {log_dir}", flush=True)
