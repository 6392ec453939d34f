"""Parsing a callback from a LightningCLI configuration, as a user's config file would name it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# `lit-trainer fit` arguments for a short test run: no bar or summary, no validation before step 1000
QUIET_FIT = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
    "--trainer.val_check_interval=1000",
]


def cli_with_callback(model_class: type, class_path: str, init_args: dict[str, Any], cli: type = LightningCLI) -> Any:
    """``cli`` (``LightningCLI`` of ``lightning.pytorch`` or of ``pytorch_lightning``), not run, for ``model_class``
    with one trainer callback given by ``class_path`` and ``init_args``; no logger, no progress bar."""
    return cli(
        model_class,
        run=False,
        args={
            "trainer": {
                "logger": False,
                "enable_progress_bar": False,
                "callbacks": [{"class_path": class_path, "init_args": init_args}],
            }
        },
    )
