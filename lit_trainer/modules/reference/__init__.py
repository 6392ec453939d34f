"""The reference model of DPO, KTO, GRPO and RLOO:
:class:`~lit_trainer.modules.reference.reference_model.ReferenceModel`, with its precompute pass beside it."""

from lit_trainer.modules.reference.reference_model import ReferenceModel, disable_dropout_in_model

__all__ = ["ReferenceModel", "disable_dropout_in_model"]
