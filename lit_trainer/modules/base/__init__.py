"""The base of every lit_trainer LightningModule, :class:`~lit_trainer.modules.base.base_module.BaseModule` (model
loading, optimizer and schedule, token-exact gradient accumulation, step logging), with the private parts it is built
from beside it in this folder."""

from lit_trainer.modules.base.base_module import BaseModule, frozen_copy

__all__ = ["BaseModule", "frozen_copy"]
