"""A check that refuses the checkpoint a run resumes from."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback


class RefuseResume(Callback):
    """Refuses the checkpoint ``fit`` loads, as a callback's check does when its saved state does not fit the run (for
    example ``BEMA``'s "state does not match the module's trainable parameters"): after the run's setup, when
    ``lit-trainer`` has already written the run's records."""

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        raise ValueError("RefuseResume: this checkpoint is refused.")
