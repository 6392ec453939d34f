"""Lightning callbacks that work on any LightningModule."""

from lit_trainer.callbacks.hf_export import HFExport

__all__ = ["HFExport"]
