"""Lightning callbacks that work on any LightningModule, for ``lightning.pytorch`` trainers.

For ``pytorch_lightning.Trainer`` (``import pytorch_lightning as pl``), import the same callbacks from
``lit_trainer.callbacks.pytorch_lightning``.
"""

from lit_trainer.callbacks.bema import BEMA
from lit_trainer.callbacks.checkpointing import BestCheckpoint
from lit_trainer.callbacks.curves import CurvesPlot
from lit_trainer.callbacks.eval_on_start import EvalOnStart
from lit_trainer.callbacks.hf_export import HFExport
from lit_trainer.callbacks.jit_checkpoint import JITCheckpoint, JITCheckpointExit, JITCheckpointFailure
from lit_trainer.callbacks.neftune import NEFTune
from lit_trainer.callbacks.resume import ExactResume
from lit_trainer.callbacks.resume_choice import resolve_resume, resolve_resume_checkpoint
from lit_trainer.callbacks.run_identity import RunIdentity

__all__ = [
    "BEMA",
    "BestCheckpoint",
    "CurvesPlot",
    "EvalOnStart",
    "ExactResume",
    "HFExport",
    "JITCheckpoint",
    "JITCheckpointExit",
    "JITCheckpointFailure",
    "NEFTune",
    "RunIdentity",
    "resolve_resume",
    "resolve_resume_checkpoint",
]
