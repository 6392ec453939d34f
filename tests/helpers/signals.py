"""A callback that sends this process a signal at a chosen optimizer step, as a scheduler (SIGTERM) or a person at a
terminal (Ctrl-C = SIGINT) would; usable by class path from a ``lit-trainer`` config (``helpers.signals.SignalAt``)."""

from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback


class SignalAt(Callback):
    """Send ``signal_name`` to this process ``times`` times at the end of the batch that completes ``step``.

    Args:
        step: the optimizer step (``trainer.global_step`` after the batch) at which to send it.
        signal_name: e.g. ``"SIGTERM"`` or ``"SIGINT"``.
        times: how often to send it (two SIGINTs = pressing Ctrl-C twice).
    """

    def __init__(self, step: int, signal_name: str = "SIGTERM", times: int = 1) -> None:
        self.step, self.signum, self.times = step, signal.Signals[signal_name], times

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
