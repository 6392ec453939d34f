"""The step-logging mixin of :class:`~lit_trainer.modules.base.BaseModule`: the logging window's device-side sums
and what is written on the steps Lightning writes logs.

Lightning logs the last micro-batch's value; we keep device-side sums over the logging window (no per-step ``.item()``)
and log, on the steps Lightning writes logs, the mean step loss of the window, the subclass's metrics averaged over the
window's micro-steps, the learning rate, the pre-clipping gradient norm, real (non-padding) tokens per second and the
padding fraction, reduced over ranks once per logging step; with the data module's ``skip_bad_rows=True`` also
``data/skipped_rows`` (the training rows skipped since the fit started, over all ranks). The learning rate is the one
the last optimizer step used (read in
:meth:`~lit_trainer.modules.base._optimization.OptimizationMixin.optimizer_step`, before Lightning steps the scheduler),
as the HF Trainer logs it.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from lit_trainer.data.samplers.lengths import cost_spread
from lit_trainer.data.samplers.rebalance import microbatch_cost


class StepLoggingMixin:
    """Logging-window state and hooks of :class:`~lit_trainer.modules.base.BaseModule` (mixed into a
    ``LightningModule``): :meth:`_track` accumulates each micro-batch, :meth:`_write_logs` reduces and logs a window."""

    def _reset_log_window(self) -> None:
        self._log_loss: Tensor | float = 0.0
        self._log_steps = 0
        self._log_metrics: dict[str, Tensor] = {}
        self._log_micro_steps = 0
        self._log_real = 0
        self._log_padded = 0
        self._log_started = time.perf_counter()
        self._excluded_time = 0.0
        self._grad_norm: Tensor | None = None
        self._step_cost = 0.0
        self._step_costs: list[float] = []

    def _track(self, contribution: Tensor, metrics: dict[str, Tensor], batch: dict[str, Any]) -> None:
        self._log_loss = self._log_loss + contribution
        self._step_loss = self._step_loss + contribution
        for key, value in metrics.items():
            self._log_metrics[key] = self._log_metrics.get(key, 0.0) + value.detach().float()
        self._log_micro_steps += 1
        for key, value in batch.items():
            if key.endswith("attention_mask") and isinstance(value, Tensor) and value.ndim == 2:
                self._log_real = self._log_real + value.sum()
                self._log_padded += value.numel()
                self._step_cost += microbatch_cost(value.shape[0], value.shape[1])
        if "position_ids" in batch and not any(key.endswith("attention_mask") for key in batch):
            # a packed batch: real tokens are all positions but the padding of shorter bins; the cost is linear
            real = batch["packed_token_mask"].sum() if "packed_token_mask" in batch else batch["position_ids"].numel()
            self._log_real = self._log_real + real
            self._log_padded += batch["position_ids"].numel()
            self._step_cost += batch["position_ids"].numel()

    def _should_write_logs(self) -> bool:
        connector = getattr(self.trainer, "_logger_connector", None)
        flag = getattr(connector, "should_update_logs", None)
        if flag is None:  # pragma: no cover - guard against Lightning internals moving
            return self.trainer.global_step % max(1, self.trainer.log_every_n_steps) == 0
        return bool(flag)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self._last_global_step:
            return  # still accumulating: no optimizer step happened on this micro-batch
        self._last_global_step = self.trainer.global_step
        self._last_step_epoch = self.trainer.current_epoch  # the counter moves on when the epoch's loop ends
        self._log_steps += 1
        self._step_costs.append(self._step_cost)
        self._step_cost = 0.0
        if not self._should_write_logs() or self._log_steps == 0:
            return
        self._write_logs()

    def _window_values(self) -> dict[str, Tensor | float]:
        """The logging window's values, reduced over ranks (every rank must call it)."""
        elapsed = max(1e-9, time.perf_counter() - self._log_started - self._excluded_time)
        world = self.trainer.world_size
        device = self.device
        names = sorted(self._log_metrics)
        skipped = getattr(self.trainer.train_dataloader, "skipped_rows", None)  # the data module's skip_bad_rows
        local = torch.stack(
            [
                torch.as_tensor(self._log_loss, dtype=torch.float32, device=device),
                torch.as_tensor(self._log_real, dtype=torch.float32, device=device),
                torch.as_tensor(float(self._log_padded), device=device),
                torch.as_tensor(float(skipped or 0), device=device),
                *[
                    torch.as_tensor(self._log_metrics[n], dtype=torch.float32, device=device) / self._log_micro_steps
                    for n in names
                ],
            ]
        )
        total = self.trainer.strategy.reduce(local, reduce_op="sum") if world > 1 else local
        values: dict[str, Tensor | float] = {
            "train_loss": total[0] / self._log_steps,
            "tokens_per_sec": total[1] / elapsed,
            "padding_fraction": 1.0 - total[1] / total[2].clamp(min=1.0),
        }
        values.update({name: total[4 + i] / world for i, name in enumerate(names)})
        if skipped is not None:
            values["data/skipped_rows"] = total[3]  # rows skipped since the fit started, summed over ranks
        if self._step_lr is not None:
            values["learning_rate"] = self._step_lr
        if self._grad_norm is not None:
            values["grad_norm"] = self._grad_norm
        if world > 1 and self._step_costs:
            values["cost_spread"] = self._cost_spread()
        return values

    #: what the progress bar shows besides ``loss`` and ``tok/s``: its label -> the logged metric (when logged), e.g.
    #: GRPO's mean reward, whose loss stays near 0 whatever the policy learns
    PROGRESS_BAR_METRICS: ClassVar[dict[str, str]] = {}

    def _write_logs(self) -> None:
        values = self._window_values()
        shown = {
            label: key for label, key in {"loss": "train_loss", **self.PROGRESS_BAR_METRICS}.items() if key in values
        }
        logged_as_shown = {label for label, key in shown.items() if label == key}  # one `log` call per name
        logged = {key: value for key, value in values.items() if key not in logged_as_shown}
        self.log_dict(logged, on_step=True, on_epoch=False, prog_bar=False, rank_zero_only=True)
        for label, key in shown.items():
            logger = label in logged_as_shown
            self.log(
                label, values[key], on_step=True, on_epoch=False, prog_bar=True, logger=logger, rank_zero_only=True
            )
        self.log(
            "tok/s",
            values["tokens_per_sec"],
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            logger=False,
            rank_zero_only=True,
        )
        self._reset_log_window()

    @override
    def on_train_end(self) -> None:
        """Write the last logging window when the run ended between two logging steps.

        Lightning writes logs only every ``log_every_n_steps`` steps, so a run of 30 steps with the default 50 would
        leave ``metrics.csv`` without a training row, and a longer run would lose its last steps.
        """
        self.write_pending_logs()

    def write_pending_logs(self) -> None:
        """Write the logging window's steps now, at the step Lightning would have used (every rank calls it).

        For a run that stops between two logging steps: at its end (:meth:`on_train_end`), or when a stopping
        callback saves a checkpoint and exits (``JITCheckpoint``, see :mod:`lit_trainer.core.stop_request`), so each
        optimizer step is in exactly one row. The values go straight to the loggers (``self.log`` is not allowed
        outside the training hooks).
        """
        if self._log_steps == 0 or not self.trainer.loggers:
            return
        values = {key: float(value) for key, value in self._window_values().items()}
        if self.trainer.is_global_zero:
            values["epoch"] = self._last_step_epoch
            for logger in self.trainer.loggers:
                logger.log_metrics(values, step=self.trainer.global_step - 1)
                logger.save()  # on disk now: the process may be about to exit
        self._reset_log_window()

    def _cost_spread(self) -> Tensor:
        """Mean over the window's steps of the ranks' relative spread of padded-token cost, ``(max - min) / max``."""
        costs = torch.tensor(self._step_costs, dtype=torch.float32, device=self.device)
        return cost_spread(self.trainer.strategy.all_gather(costs)).mean()  # all_gather: (world, steps)

    @override
    def on_validation_start(self) -> None:
        self._validation_started = time.perf_counter()

    @override
    def on_validation_end(self) -> None:
        self._excluded_time += time.perf_counter() - getattr(self, "_validation_started", time.perf_counter())
