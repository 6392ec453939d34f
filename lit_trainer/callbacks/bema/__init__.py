"""BEMA: bias-corrected exponential moving average of the weights (see docs/design.md#trl-bema).

The code is in :mod:`lit_trainer.callbacks.bema.bema`;
its private parts are beside it in this folder."""

from lit_trainer.callbacks.bema._math import bema_coefficients
from lit_trainer.callbacks.bema.bema import BEMA

__all__ = ["BEMA", "bema_coefficients"]
