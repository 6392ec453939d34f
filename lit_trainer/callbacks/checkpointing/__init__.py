"""BestCheckpoint: save only on improvement, keep the N newest, load the best at the end, export it for HF.

The code is in :mod:`lit_trainer.callbacks.checkpointing.best_checkpoint`;
its private parts are beside it in this folder."""

from lit_trainer.callbacks.checkpointing.best_checkpoint import HF_EXPORT_DIRNAME, BestCheckpoint, infer_mode

__all__ = ["HF_EXPORT_DIRNAME", "BestCheckpoint", "infer_mode"]
