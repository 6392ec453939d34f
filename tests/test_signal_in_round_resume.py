"""A just-in-time checkpoint saved inside an optimizer step resumes exactly at ``steps_per_generation=1``.

A signal that lands while a GRPO round is generated (synchronous GRPO) or while the trainer waits for the rollout
worker's round (asynchronous GRPO, ``max_staleness``) drops the round: ``JITCheckpoint.stop_in_step`` saves the last
finished optimizer step from inside the batch that started the round, and Lightning resumes that checkpoint at the
batch, so the round is generated again. The loader's saved position used to count that batch (it had been handed to
the training loop), so the resumed run trained the next micro-batch's prompts at every step: hidden at
``steps_per_generation=2``, whose loader yields each generation batch twice in a row (``tests/test_signal_stops.py``).

Here each stopped run is resumed with ``ckpt_path`` and its final weights must equal an uninterrupted run's
(``torch.equal``, CPU), and the checkpoint's loader position must be the batch Lightning resumes at.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_grpo_async_resume import token_sum_reward
from test_grpo_module import QUIET, data, grpo

from lit_trainer.callbacks import ExactResume, JITCheckpoint
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit

STEPS = 5  # optimizer steps of a run (10 for a stop at the first batch of the second epoch)


class SignalInRound(Callback):
    """Send this process ``signal_name`` once, inside the round that starts optimizer step ``step``: from within the
    policy's ``generate`` call (synchronous GRPO; its stopping criterion sees the request at the next token), or as
    the trainer starts waiting for the worker's round (asynchronous GRPO: from within ``worker.receive``)."""

    def __init__(self, step: int, signal_name: str = "SIGTERM") -> None:
        self.step, self.signum, self.armed, self.sent = step, signal.Signals[signal_name], False, False

    def _wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.sent:
                self.sent = True
                os.kill(os.getpid(), self.signum)
            return inner(*args, **kwargs)

        setattr(owner, name, wrapped)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self.armed:
            return
        self.armed = True
        if pl_module.hparams.max_staleness is None:
            self._wrap(pl_module.model, "generate")
        else:
            self._wrap(pl_module.async_rollouts.worker, "receive")


def _fit(
    root: Path, callbacks: list, ckpt_path: str | None = None, accumulate: int = 1, steps: int = STEPS, **options: Any
) -> Any:
    """A tiny GRPO fit (16 prompts, 8 completions per micro-step: 8 micro-batches an epoch) with the recipes'
    ``ExactResume`` and ``JITCheckpoint`` (SIGTERM and Ctrl-C, no ``kill_wait``); returns the module."""
    L.seed_everything(0)
    module = grpo(reward_funcs=[token_sum_reward], steps_per_generation=1, **options)
    callbacks = [ExactResume(), JITCheckpoint(kill_wait=0.0, signals=["SIGTERM", "SIGINT"]), *callbacks]
    trainer = L.Trainer(
        max_steps=steps,
        callbacks=callbacks,
        accumulate_grad_batches=accumulate,
        default_root_dir=root,
        **QUIET,
    )
    trainer.fit(module, datamodule=data(n=16, batch_size=8), ckpt_path=ckpt_path)
    return module


def _stop_and_resume(tmp_path: Path, stop: int, signal_name: str = "SIGTERM", **options: Any) -> tuple[Any, Any]:
    """The uninterrupted run's module and the resumed one's, after a stop in the round of step ``stop``."""
    whole = _fit(tmp_path / "whole", [], **options)
    with pytest.raises(JITCheckpointExit) as stopped:
        _fit(tmp_path / "first", [SignalInRound(stop, signal_name)], **options)
    assert stopped.value.code == 128 + signal.Signals[signal_name]
    path = stopped.value.checkpoint_path
    epoch = stop * options.get("accumulate", 1) // 8
    assert Path(path).name == f"last-jit-epoch={epoch}-step={stop}.ckpt"  # the step before the dropped round

    saved = torch.load(path, weights_only=False)
    fit_loop = saved["loops"]["fit_loop"]
    (position,) = fit_loop["state_dict"]["combined_loader"]
    resumes_at = fit_loop["epoch_loop.batch_progress"]["current"]["completed"]  # Lightning's resumed batch
    assert resumes_at == stop * options.get("accumulate", 1) % 8  # inside the batch that starts step `stop`
    assert position["position"] == resumes_at, "the loader resumes at another batch than Lightning"

    resumed = _fit(tmp_path / "resumed", [], ckpt_path=path, **options)
    at_stop = {k[len("model.") :]: v for k, v in saved["state_dict"].items() if k.startswith("model.")}
    assert any(not torch.equal(v, at_stop[k]) for k, v in whole.model.state_dict().items())  # steps after it moved
    return whole, resumed


def _same_weights(whole: Any, resumed: Any) -> None:
    theirs, ours = whole.model.state_dict(), resumed.model.state_dict()
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name


@pytest.mark.parametrize("accumulate", [1, 2])
def test_sigterm_during_a_synchronous_round_resumes_exactly(tmp_path: Path, accumulate: int):
    _same_weights(*_stop_and_resume(tmp_path, 3, accumulate=accumulate))


def test_sigterm_in_the_first_round_of_an_epoch_resumes_exactly(tmp_path: Path):
    _same_weights(*_stop_and_resume(tmp_path, 8, steps=10))


def test_ctrl_c_during_a_synchronous_round_resumes_exactly(tmp_path: Path):
    _same_weights(*_stop_and_resume(tmp_path, 3, "SIGINT"))


@pytest.mark.slow  # starts a rollout worker (the first in a process: ~10 s of CPU)
@pytest.mark.parametrize(("signal_name", "k"), [("SIGTERM", 1), ("SIGINT", 2)])
def test_a_signal_while_waiting_for_the_workers_round_resumes_exactly(tmp_path: Path, signal_name: str, k: int):
    """SIGTERM at max_staleness=1, Ctrl-C at 2: the checkpoint also carries the weights versions of the rounds in
    flight (tests/test_grpo_async_resume.py), so the resumed run's stale rounds are the uninterrupted run's."""
    whole, resumed = _stop_and_resume(tmp_path, 3, signal_name, max_staleness=k)
    _same_weights(whole, resumed)
