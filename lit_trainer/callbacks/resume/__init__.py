"""Bit-exact resume: per-rank RNG states, loader replay and window gradients in the checkpoint.

The code is in :mod:`lit_trainer.callbacks.resume.exact_resume`;
its private parts are beside it in this folder."""

from lit_trainer.callbacks.resume.exact_resume import ExactResume

__all__ = ["ExactResume"]
