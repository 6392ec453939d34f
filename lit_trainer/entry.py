"""Moved to :mod:`lit_trainer.cli.entry`; kept so that a ``lit-trainer`` script installed before the move (its
wrapper imports ``lit_trainer.entry:main``) keeps working until the package is reinstalled."""

from lit_trainer.cli.entry import main

__all__ = ["main"]
