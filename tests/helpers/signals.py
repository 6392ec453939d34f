"""Callbacks for signal tests, usable by class path from a ``lit-trainer`` config: ``helpers.signals.SignalAt`` sends
this process a signal at a chosen optimizer step, as a scheduler (SIGTERM) or a person at a terminal (Ctrl-C =
SIGINT) would; ``helpers.signals.EndlessRoundAt`` makes GRPO generation rounds take hours, for a signal sent from
outside while a round runs."""

from __future__ import annotations

import copy
import json
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


class EndlessRoundAt(Callback):
    """From optimizer step ``step`` on, every ``generate`` call of a GRPO module asks for 100,000 new tokens with EOS
    suppressed (a round that would take hours on CPU), on this rank; for a test that signals one rank of a DDP run.

    Files in ``out`` (``R`` = this process's global rank): ``generating_rankR.json`` (``{"pid"}``, written right
    before such a call), ``generated_rankR.json`` (``{"tokens"}``: how many it generated, once it returned), and
    ``stop_rankR.json`` (how the fit ended: exception, its code, ``global_step``). The weights are untouched, so a run
    stopped in that round saves the same state as a run that never had this callback.
    """

    TOKENS = 100_000

    def __init__(self, out: str, step: int) -> None:
        self.out, self.step, self._patched = out, step, False

    def _write(self, trainer, what: str, data: dict) -> None:
        path = os.path.join(self.out, f"{what}_rank{trainer.global_rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)  # a reader never sees half a file

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self._patched:
            return
        self._patched = True
        model, inner = pl_module.model, pl_module.model.generate

        def generate(*args, generation_config, **kwargs):
            config = copy.deepcopy(generation_config)
            config.max_new_tokens = config.min_new_tokens = self.TOKENS
            self._write(trainer, "generating", {"pid": os.getpid()})
            out = inner(*args, generation_config=config, **kwargs)
            self._write(trainer, "generated", {"tokens": out.shape[1] - kwargs["input_ids"].shape[1]})
            return out

        model.generate = generate

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        code = getattr(exception, "code", None)
        self._write(trainer, "stop", {"exception": type(exception).__name__, "code": code, "step": trainer.global_step})
