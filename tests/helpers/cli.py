"""Parsing a callback from a LightningCLI configuration, as a user's config file would name it."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import LightningCLI


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
