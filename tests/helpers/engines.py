"""Rollout engines for the asynchronous GRPO tests, named by import path (the worker process builds them)."""

from __future__ import annotations

from typing import Any

from lit_trainer.modules.grpo import GenerateEngine


class NoWeightSync(GenerateEngine):
    """Samples with ``generate`` but never loads the weights the trainer publishes: a weight sync that silently
    failed (the worker keeps the policy it started with)."""

    def load_weights(self, model: Any, weights: Any) -> None:
        return None


class Sleeping(GenerateEngine):
    """``generate`` that sleeps ten minutes first: a round stuck in code that checks nothing (as a tool or an engine
    waiting on a server that never answers)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        import time

        time.sleep(600)
        return super().generate(*args, **kwargs)
