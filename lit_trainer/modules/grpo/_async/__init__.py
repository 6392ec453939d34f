"""Asynchronous GRPO rollouts: a worker process generates the next rounds while the trainer trains on this one.

The code is in :mod:`lit_trainer.modules.grpo._async.async_rollouts`;
its private parts are beside it in this folder."""

from lit_trainer.modules.grpo._async.async_rollouts import (
    CLOSE_SECONDS,
    STATE_KEY,
    AsyncOptions,
    AsyncRollouts,
    RolloutWorker,
    strip_hooks,
    worker_context,
)

__all__ = [
    "CLOSE_SECONDS",
    "STATE_KEY",
    "AsyncOptions",
    "AsyncRollouts",
    "RolloutWorker",
    "strip_hooks",
    "worker_context",
]
