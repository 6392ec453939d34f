"""``lit-trainer fit --report_to trackio,tensorboard``: choosing experiment trackers by name, as the HF Trainer does.

Each name stands for a Lightning logger (the long form is ``--trainer.logger``). The run folder's CSV logger is always
kept: ``metrics.csv``, the final metrics table, the curves picture and the resume records are built on it, so
``csv`` is accepted and changes nothing, and ``none`` means the CSV logger alone. ``all`` means every tracker that is
installed. Loggers in ``--trainer.logger`` that are not one of these trackers (a logger of your own) are kept.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

# name -> (logger class path, the importable module it needs, how to install it)
TRACKERS: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("lightning.pytorch.loggers.TensorBoardLogger", "tensorboard", "pip install tensorboard"),
    "trackio": ("lit_trainer.loggers.TrackioLogger", "trackio", 'pip install "lit_trainer[trackio]"'),
    "wandb": ("lightning.pytorch.loggers.WandbLogger", "wandb", "pip install wandb"),
    "mlflow": ("lightning.pytorch.loggers.MLFlowLogger", "mlflow", "pip install mlflow"),
}
ALWAYS = "csv"
SPECIAL = ("all", "none")
CSV_LOGGER = "lit_trainer.cli.runs.RunCSVLogger"
# class names (the end of a class path) that --report_to replaces in --trainer.logger
_TRACKER_CLASSES = tuple(path.rsplit(".", 1)[-1] for path, _, _ in TRACKERS.values())
REPORT_TO_HELP = (
    "Experiment trackers, comma-separated, as the HF Trainer's report_to: "
    + ", ".join(TRACKERS)
    + "; 'all' (every installed one) or 'none'. The run folder's metrics.csv is always written ('csv'). Unset: "
    "TensorBoard when it is installed, or what --trainer.logger says (the long form, for any Lightning logger). "
    "(type: str | None, default: null)"
)


def installed(name: str) -> bool:
    """Whether the module tracker ``name`` needs can be imported (without importing it)."""
    return importlib.util.find_spec(TRACKERS[name][1]) is not None


def parse_report_to(value: str | list[str]) -> list[str]:
    """The tracker names of a ``--report_to`` value, in order, without ``csv`` (always on) and duplicates.

    Args:
        value: ``"trackio,tensorboard"``, ``"all"``, ``"none"`` (or a list of names, as in a YAML config).

    Raises:
        ValueError: an unknown name (with the valid ones and a close match), ``all``/``none`` mixed with other
            names, or a tracker whose package is not installed (with the ``pip install`` line).

    Example:
        >>> parse_report_to("csv, none"), parse_report_to("tensorboard,tensorboard")
        ([], ['tensorboard'])
    """
    items = value if isinstance(value, list) else str(value).replace(" ", ",").split(",")
    names = list(dict.fromkeys(item.strip().lower() for item in items if str(item).strip()))
    valid = [*TRACKERS, ALWAYS, *SPECIAL]
    for name in names:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"--report_to: unknown tracker '{name}'.{hint} Choose from {', '.join(valid)} "
                "(comma-separated, e.g. --report_to trackio,tensorboard)."
            )
    special = [name for name in names if name in SPECIAL]
    if special and len([n for n in names if n != ALWAYS]) > 1:
        raise ValueError(f"--report_to: '{special[0]}' cannot be combined with other names (got {value!r}).")
    if "all" in names:
        return [name for name in TRACKERS if installed(name)]
    chosen = [name for name in names if name in TRACKERS]
    missing = [name for name in chosen if not installed(name)]
    if missing:
        lines = "; ".join(f"{name}: {TRACKERS[name][2]}" for name in missing)
        raise ValueError(f"--report_to: not installed ({lines}).")
    return chosen


def _entry(class_path: str, init_args: dict[str, Any]) -> Namespace:
    return Namespace(class_path=class_path, init_args=Namespace(**init_args))


def tracker_loggers(names: list[str], configured: list[Any], root: str) -> list[Namespace]:
    """The ``trainer.logger`` list for ``--report_to names``: the run's CSV logger first (the one configured, else a
    new one), the configured loggers that are not trackers, then one logger per name.

    Folder, run name and version are filled in later with the other run-folder loggers (``save_dir``, ``name``,
    ``version``) or, for W&B and MLflow, by :func:`place_remote_trackers`.
    """
    folder = {"save_dir": root, "name": None, "version": None}
    is_csv = [str(e.get("class_path", "")).endswith("CSVLogger") for e in configured]
    csv = [e for e, yes in zip(configured, is_csv, strict=True) if yes][:1] or [_entry(CSV_LOGGER, dict(folder))]
    others = [
        e
        for e, yes in zip(configured, is_csv, strict=True)
        if not yes and not str(e.get("class_path", "")).endswith(_TRACKER_CLASSES)
    ]
    per_name = {
        "tensorboard": {**folder, "default_hp_metric": False},
        "trackio": dict(folder),
        "wandb": {},
        "mlflow": {},
    }
    return [*csv, *others, *(_entry(TRACKERS[name][0], per_name[name]) for name in names)]


def place_remote_trackers(loggers: list[Any], root: str, run_name: str, version_name: str) -> None:
    """Give W&B and MLflow loggers from ``--report_to`` this run's names, where the config left them unset.

    W&B: ``save_dir`` the run folder, ``name`` ``<run name>-version_<n>``, ``project`` ``$WANDB_PROJECT`` else
    ``lit_trainer``. MLflow: experiment ``<run name>``, run ``<run name>-version_<n>``, a file store under the root
    (``<root>/mlruns``) unless ``MLFLOW_TRACKING_URI`` is set.
    """
    label = f"{run_name}-{version_name}"
    for entry in loggers:
        path = str(entry.get("class_path", ""))
        args = entry.get("init_args")
        if args is None:
            continue
        if path.endswith("WandbLogger"):
            defaults = {
                "save_dir": str(Path(root) / run_name / version_name),
                "name": label,
                "project": os.environ.get("WANDB_PROJECT", "lit_trainer"),
            }
        elif path.endswith("MLFlowLogger"):
            defaults = {"experiment_name": run_name, "run_name": label, "save_dir": str(Path(root) / "mlruns")}
        else:
            continue
        for key, value in defaults.items():
            if args.get(key) is None:
                args[key] = value
