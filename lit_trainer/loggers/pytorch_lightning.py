"""The same loggers for projects that use the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

``pytorch_lightning.Trainer`` only accepts loggers of its own package, so :class:`TrackioLogger` exists twice, built
from one implementation: ``from lit_trainer.loggers import TrackioLogger`` for ``lightning.Trainer``, and
``from lit_trainer.loggers.pytorch_lightning import TrackioLogger`` for ``pytorch_lightning.Trainer``. Same
arguments and behaviour. Importing this module needs the ``pytorch_lightning`` package.
"""

from __future__ import annotations

from lit_trainer.core.lightning_namespace import namespace
from lit_trainer.loggers import trackio

namespace("pytorch_lightning")  # a clear error when the package is missing
from pytorch_lightning.loggers import Logger  # noqa: E402  (after the check)

TrackioLogger = type(
    "TrackioLogger",
    (trackio._TrackioLogger, Logger),
    {"__module__": __name__, "__qualname__": "TrackioLogger", "__doc__": trackio.TrackioLogger.__doc__},
)

__all__ = ["TrackioLogger"]
