"""RunIdentity: record which run wrote a checkpoint, and refuse to resume a different run from it.

A checkpoint of a DPO run loads into an SFT module without error when the parameter names match (both hold
``model.*``), and Lightning then restores the DPO run's optimizer, scheduler and step counter. To make that
impossible, every checkpoint gets a small record (``checkpoint["lit_trainer_run"]``):

* ``module``: the LightningModule's class path;
* ``datamodule``: the LightningDataModule's class path (``None`` without one);
* ``run_name``: the run's name (the logger's ``name``; ``sft``, ``dpo``, ``grpo`` by default in ``lit-trainer``);
* ``run_dir``: the folder the run logged to (where a resumed run continues).

"Same run configuration" means the first three are equal. Everything else (``max_steps``, learning rate, batch
size, ...) may change on a resume, as it may in Lightning. A checkpoint without a record (written elsewhere) is
loaded with a warning that it could not be checked.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

RECORD_KEY = "lit_trainer_run"
IDENTITY_KEYS = ("module", "datamodule", "run_name")


def class_path(obj_or_type: Any) -> str | None:
    """``package.module.Class`` of an object or a class (``None`` for ``None``)."""
    if obj_or_type is None:
        return None
    cls = obj_or_type if isinstance(obj_or_type, type) else type(obj_or_type)
    return f"{cls.__module__}.{cls.__qualname__}"


def identity_mismatch(recorded: dict[str, Any], current: dict[str, Any], checkpoint: str | os.PathLike) -> str | None:
    """The refusal message when ``recorded`` (from the checkpoint) and ``current`` are different runs, else ``None``.

    Example:
        >>> identity_mismatch({"module": "a.SFT", "run_name": "sft"}, {"module": "a.SFT", "run_name": "sft"}, "x")
        >>> identity_mismatch({"module": "a.GRPO"}, {"module": "a.SFT"}, "x.ckpt")[:60]
        'Refusing to resume from x.ckpt: it was written by another ru'
    """
    differ = [key for key in IDENTITY_KEYS if recorded.get(key) != current.get(key)]
    if not differ:
        return None
    details = "; ".join(f"{key}: checkpoint {recorded.get(key)!r}, this run {current.get(key)!r}" for key in differ)
    return (
        f"Refusing to resume from {checkpoint}: it was written by another run ({details}). Resume it with the "
        "same module, data module and run name, or start a fresh run without --ckpt_path (from Python: "
        "ckpt_path=None)."
    )


def read_record(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The run record of a checkpoint file, or ``None`` (no record, or a sharded checkpoint folder).

    The file is memory-mapped, so only the small record is actually read, and loaded with ``weights_only=True`` (no
    arbitrary code runs before the user's own ``fit`` loads it); a checkpoint that needs more is reported as having
    no record here, and :class:`RunIdentity` still checks it when ``fit`` loads it.
    """
    if os.path.isdir(checkpoint):
        return None
    try:
        state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError:
        return None
    return state.get(RECORD_KEY)


class RunIdentity(Callback):
    """Write the run record into every checkpoint; refuse ``fit(ckpt_path=...)`` from another run's checkpoint.

    ``lit-trainer`` adds it to every run. Works with any LightningModule.

    Args:
        run_name: the run's name; ``None`` takes the first logger's ``name`` (``None`` without a logger).

    Example::

        trainer = Trainer(callbacks=[RunIdentity()], logger=CSVLogger("runs", name="sft"))
        trainer.fit(module, datamodule=dm, ckpt_path="runs/dpo/version_0/checkpoints/last.ckpt")  # ValueError
    """

    def __init__(self, run_name: str | None = None) -> None:
        self.run_name = run_name

    def current(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """This run's record."""
        logger = trainer.loggers[0] if trainer.loggers else None
        return {
            "module": class_path(pl_module),
            "datamodule": class_path(getattr(trainer, "datamodule", None)),
            "run_name": self.run_name if self.run_name is not None else getattr(logger, "name", None),
            "run_dir": getattr(logger, "log_dir", None),  # not trainer.log_dir: that one is a collective
        }

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[RECORD_KEY] = self.current(trainer, pl_module)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        recorded = checkpoint.get(RECORD_KEY)
        where = trainer.ckpt_path or "the checkpoint"
        if recorded is None:
            rank_zero_warn(
                f"{where} has no lit_trainer run record (it was not written with RunIdentity), so "
                "whether it belongs to this run could not be checked."
            )
            return
        message = identity_mismatch(recorded, self.current(trainer, pl_module), where)
        if message is not None:
            raise ValueError(message)
