"""Moved to :mod:`lit_trainer.cli.runs`; kept so that saved configurations naming
``lit_trainer.runs.RunCSVLogger`` (every run folder's ``config.yaml`` before the move) still load."""

from lit_trainer.cli.runs import RunCSVLogger

__all__ = ["RunCSVLogger"]
