"""Kept for test files of branches in flight; remove after the merge (use ``helpers.accumulation``)."""

from helpers.accumulation import TEXTS, GradCapture, accum_datamodule, full_batch_gradient, relative_error  # noqa: F401
