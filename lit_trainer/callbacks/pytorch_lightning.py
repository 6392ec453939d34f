"""The same callbacks for projects that use the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

``lightning.pytorch`` and ``pytorch_lightning`` are two copies of Lightning whose classes are distinct, and a trainer
only recognises callbacks of its own package (``pytorch_lightning.Trainer`` looks for a
``pytorch_lightning.callbacks.Checkpoint``; its helpers refuse a ``lightning.pytorch`` module). So each callback
exists twice, built from one implementation (see ``lit_trainer/core/lightning_namespace.py``):

* ``from lit_trainer.callbacks import BestCheckpoint`` for ``lightning.Trainer`` / ``lightning.pytorch.Trainer``;
* ``from lit_trainer.callbacks.pytorch_lightning import BestCheckpoint`` for ``pytorch_lightning.Trainer`` (and
  ``class_path: lit_trainer.callbacks.pytorch_lightning.BestCheckpoint`` in a ``pytorch_lightning`` CLI config).

The checkpoint plugin ``AtomicCheckpointIO`` (``lit_trainer.checkpoint_io``) has its twin here too.

Same arguments, behaviour and checkpoint state keys (a checkpoint written under one package resumes under the other
as far as Lightning itself allows). Importing this module needs the ``pytorch_lightning`` package.
"""

from __future__ import annotations

from lit_trainer.callbacks import bema, checkpointing, curves, eval_on_start, hf_export, jit_checkpoint, neftune, resume
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit, JITCheckpointFailure
from lit_trainer.checkpoint_io import atomic_checkpoint_io_class
from lit_trainer.core.lightning_namespace import namespace, twin

namespace("pytorch_lightning")  # a clear error when the package is missing
from lightning_fabric.plugins import CheckpointIO  # noqa: E402  (after the check: it comes with pytorch_lightning)

BEMA = twin(bema.BEMA, "pytorch_lightning", __name__)
BestCheckpoint = twin(checkpointing.BestCheckpoint, "pytorch_lightning", __name__)
CurvesPlot = twin(curves.CurvesPlot, "pytorch_lightning", __name__)
EvalOnStart = twin(eval_on_start.EvalOnStart, "pytorch_lightning", __name__)
ExactResume = twin(resume.ExactResume, "pytorch_lightning", __name__)
HFExport = twin(hf_export.HFExport, "pytorch_lightning", __name__)
JITCheckpoint = twin(jit_checkpoint.JITCheckpoint, "pytorch_lightning", __name__)
NEFTune = twin(neftune.NEFTune, "pytorch_lightning", __name__)
AtomicCheckpointIO = atomic_checkpoint_io_class(CheckpointIO)  # a plugin, not a callback: Trainer(plugins=[...])
AtomicCheckpointIO.__module__ = __name__

__all__ = [
    "BEMA",
    "AtomicCheckpointIO",
    "BestCheckpoint",
    "CurvesPlot",
    "EvalOnStart",
    "ExactResume",
    "HFExport",
    "JITCheckpoint",
    "JITCheckpointExit",
    "JITCheckpointFailure",
    "NEFTune",
]
