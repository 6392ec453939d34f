"""``lit-trainer``: a LightningCLI with LLM-friendly defaults.

What it changes from a plain ``LightningCLI`` (reference/lightning.md 1.9 and section 2):

* model and data classes are chosen by ``class_path`` (``--model=lit_trainer.DPOModule``), and the model's name or
  path is linked to the data module's ``tokenizer``, so they never disagree;
* optimizers and schedulers are injected into the module (``OptimizerCallable``/``LRSchedulerCallable``, trainable
  parameters only, stepped per optimizer step); the CLI's automatic ``--optimizer`` is off;
* a fixed default seed (1234) instead of a random one, so a rerun or resume is reproducible;
* the saved ``config.yaml`` may be overwritten (resuming into the same run directory works);
* loggers default to CSV, plus TensorBoard when it is installed, under ``runs/<run_name>``;
* no sanity-check validation by default (generation-based validation is costly and its result is thrown away);
* ``fit`` refuses to run without ``max_steps`` or ``max_epochs`` (Lightning would silently run 1000 epochs);
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lit_trainer.callbacks.checkpoint_resolution import resolve_resume

from lit_trainer.data.base import BaseDataModule
from lit_trainer.modules.base import BaseModule

DEFAULT_SEED = 1234


def next_version(save_dir: str, run_name: str) -> str:
    """``version_<n>`` with ``n`` one past the highest existing version of ``<save_dir>/<run_name>``."""
    root = Path(save_dir) / run_name
    taken = [int(p.name.split("_", 1)[1]) for p in root.glob("version_*") if p.name.split("_", 1)[1].isdigit()]
    return f"version_{max(taken, default=-1) + 1}"


def default_loggers(run_name: str = "lit_trainer", save_dir: str = "runs") -> list[dict[str, Any]]:
    """CSV always; TensorBoard too when ``tensorboard`` is importable; both write into the same version directory."""
    common = {"save_dir": save_dir, "name": run_name, "version": next_version(save_dir, run_name)}
    loggers = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": dict(common)}]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append({"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {**common, "default_hp_metric": False}})
    return loggers


def checkpoint_dirs(trainer: Any) -> list[str]:
    """Where ``--ckpt_path last`` looks: the explicit ``dirpath`` of every checkpointing callback, and the
    ``checkpoints/`` folders of every version of this run name (the default location of ``ModelCheckpoint``)."""
    dirs = [str(d) for cb in trainer.callbacks if (d := getattr(cb, "dirpath", None))]
    for logger in trainer.loggers:
        save_dir, name = getattr(logger, "save_dir", None), getattr(logger, "name", None)
        if save_dir and name:
            dirs += sorted(str(p) for p in (Path(save_dir) / name).glob("version_*/checkpoints"))
    return list(dict.fromkeys(dirs))


class LitTrainerCLI(LightningCLI):
    """The ``lit-trainer`` command (``fit``, ``validate``, ``test``, ``predict`` subcommands, ``--config``,
    ``--print_config``)."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        trainer_defaults = {"logger": default_loggers(), "num_sanity_val_steps": 0}
        trainer_defaults.update(kwargs.pop("trainer_defaults", {}))
        super().__init__(
            model_class=BaseModule,
            datamodule_class=BaseDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            seed_everything_default=DEFAULT_SEED,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            trainer_defaults=trainer_defaults,
            args=args,
            run=run,
            **kwargs,
        )

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Link the model's name/path to the data module's tokenizer."""
        parser.link_arguments("model.init_args.model", "data.init_args.tokenizer", apply_on="parse")

    def before_fit(self) -> None:
        """Refuse an unbounded run; resolve ``ckpt_path`` explicitly (never a silent resume)."""
        trainer = self.trainer
        if trainer.max_steps == -1 and trainer.max_epochs in (None, -1):
            raise ValueError("Set `trainer.max_steps` (or `trainer.max_epochs`): without either, Lightning would run "
                             "1000 epochs.")
        config = self.config_init[self.config_init.subcommand]
        requested = config.get("ckpt_path")
        resume = "never" if requested is None else "auto" if requested in ("last", "auto") else requested
        config["ckpt_path"] = resolve_resume(resume, checkpoint_dirs(trainer), trainer)
        if resume == "auto":
            found = config["ckpt_path"]
            rank_zero_info(f"[lit_trainer] resuming from {found}" if found else
                           "[lit_trainer] --ckpt_path last: no complete checkpoint found, starting fresh")


def main(args: Any = None) -> None:
    """Entry point of the ``lit-trainer`` console script."""
    LitTrainerCLI(args=args if args is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
