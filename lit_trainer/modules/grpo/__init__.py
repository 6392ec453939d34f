"""GRPO: :class:`~lit_trainer.modules.grpo.grpo_module.GRPOModule`, with its private parts beside it (the step's token
normaliser, the entropy control and ``_async/``, the asynchronous rollout worker). The engines are
:mod:`lit_trainer.generation`'s, exported here too as in earlier versions."""

from lit_trainer.generation import ContinuousBatchingEngine, GenerateEngine, RolloutEngine
from lit_trainer.modules.grpo.grpo_module import GRPOModule

__all__ = ["ContinuousBatchingEngine", "GRPOModule", "GenerateEngine", "RolloutEngine"]
