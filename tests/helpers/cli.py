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


def fit_recipe(config: str, cwd: Path, *args: str) -> None:
    """``lit-trainer fit --config configs/<config>`` in ``cwd``, quiet (:data:`QUIET_FIT`), logging every step, with
    ``args`` last; fails the test with the command's output if it does not succeed."""
    from helpers.ddp import output_tail, run_lit_trainer

    proc = run_lit_trainer("fit", "--config", CONFIGS / config, *QUIET_FIT, "--trainer.log_every_n_steps=1", *args,
                           cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, output_tail(proc)


def logged_rows(run: Path) -> list[dict[str, str]]:
    """The rows of a run folder's ``metrics.csv``."""
    import csv

    with open(run / "metrics.csv") as f:
        return list(csv.DictReader(f))
