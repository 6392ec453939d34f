"""Rollout generation shared by the online-RL modules (GRPO, RLOO) and their asynchronous rollout worker.

:class:`RolloutGenerator` holds the sampling options and the engine and samples a round (:class:`Round`);
:class:`RolloutEngine` is the extension point an engine (``generate``, continuous batching, or a third-party one such
as vLLM) implements. See docs/customizing.md and docs/design.md.
"""

from lit_trainer.generation.engines import (
    Completions,
    ContinuousBatchingEngine,
    GenerateEngine,
    RolloutEngine,
    make_engine,
)
from lit_trainer.generation.generator import RolloutGenerator, Round, SamplingOptions

__all__ = [
    "Completions",
    "ContinuousBatchingEngine",
    "GenerateEngine",
    "RolloutEngine",
    "RolloutGenerator",
    "Round",
    "SamplingOptions",
    "make_engine",
]
