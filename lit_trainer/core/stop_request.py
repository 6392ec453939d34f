"""Stopping long work inside a training step when a callback asks for it: the contract between a stopping callback
(:class:`~lit_trainer.callbacks.JITCheckpoint` after a signal) and a module whose step can run for minutes (GRPO's
generation round). Duck-typed, so callbacks never import modules and any module or callback can take part.

A *stop requester* is a trainer callback with

* ``stop_requested`` (bool, cheap: read on every generated token): the step in progress should give up now (under
  DDP also when another rank's request is due: it must not wait for the all-reduce below to learn of it);
* ``stop_in_step(trainer)``: called by the module on every rank at the same point of a step that has changed
  nothing yet (no backward since the last optimizer step): if any rank's request is due (a collective), the callback
  saves the state of the last finished optimizer step and raises; otherwise it returns.

A stop requester may also offer ``stop_for_failure(trainer, reason)``: code that meets a failure where the training
state is whole on this rank (the last optimizer step finished, nothing of the next one applied) calls it to have the
last finished step saved before the run stops with ``reason`` (it raises then; it returns when it cannot save, and
the caller raises its own error).

A module that may be asked to stop implements ``write_pending_logs()`` when it keeps logs for a later logging step
(:class:`~lit_trainer.modules.base.BaseModule`'s logging window): the requester calls it before saving, so the last
steps of a stopped run are logged once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def stop_requester(trainer: Any) -> Any | None:
    """The first callback of ``trainer`` that can stop a step (``stop_requested`` and ``stop_in_step``), or None."""
    for callback in getattr(trainer, "callbacks", None) or []:
        if hasattr(callback, "stop_requested") and callable(getattr(callback, "stop_in_step", None)):
            return callback
    return None


def stop_check(trainer: Any) -> Callable[[], bool] | None:
    """A no-argument check that is True once the requester wants the step in progress to stop (None without one)."""
    requester = stop_requester(trainer)
    if requester is None:
        return None
    return lambda: bool(requester.stop_requested)


def stop_in_step(trainer: Any) -> None:
    """Let the requester save and stop the run here if a stop is due on any rank (every rank must call it)."""
    requester = stop_requester(trainer)
    if requester is not None:
        requester.stop_in_step(trainer)


def stop_for_failure(trainer: Any, reason: str) -> None:
    """Let the first callback of ``trainer`` that saves on failures (``stop_for_failure``) save the last finished
    optimizer step and stop the run with ``reason``; returns when there is none or it cannot save (the caller then
    raises its own error)."""
    for callback in getattr(trainer, "callbacks", None) or []:
        save = getattr(callback, "stop_for_failure", None)
        if callable(save):
            save(trainer, reason)
            return
