"""A callback that sends this process a signal at a chosen optimizer step, as a scheduler (SIGTERM) or a person at a
terminal (Ctrl-C = SIGINT) would; usable by class path from a ``lit-trainer`` config (``helpers.signals.SignalAt``)."""

from __future__ import annotations

import os
import signal
import threading

from lightning.pytorch.callbacks import Callback


class SignalAt(Callback):
    """Send ``signal_name`` to this process ``times`` times at the end of the batch that completes ``step``.

    Args:
        step: the optimizer step (``trainer.global_step`` after the batch) at which to send it.
        signal_name: e.g. ``"SIGTERM"`` or ``"SIGINT"``.
        times: how often to send it (two SIGINTs = pressing Ctrl-C twice).
        at_start: send it instead at the start of the first batch after ``step`` steps (before that batch's training
            step runs: a GRPO generation round starts inside it).
        delay: seconds to wait (on a timer thread) before sending: the signal then arrives while the batch runs.
    """

    def __init__(
        self, step: int, signal_name: str = "SIGTERM", times: int = 1, at_start: bool = False, delay: float = 0.0
    ) -> None:
        self.step, self.signum, self.times = step, signal.Signals[signal_name], times
        self.at_start, self.delay, self._sent = at_start, delay, False

    def _send(self) -> None:
        for _ in range(self.times):
            os.kill(os.getpid(), self.signum)

    def _maybe_send(self, trainer) -> None:
        if trainer.global_step != self.step or self._sent:
            return
        self._sent = True
        if self.delay > 0:
            threading.Timer(self.delay, self._send).start()
        else:
            self._send()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.at_start:
            self._maybe_send(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.at_start:
            self._maybe_send(trainer)


def distinct_tokens_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """A GRPO reward that differs between sampled completions (their number of distinct tokens), so that a tiny
    untrained policy gets non-zero advantages and its weights move at every step."""
    return [float(len(set(ids))) for ids in completion_ids]
