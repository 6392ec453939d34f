"""RunIdentity: record which run wrote a checkpoint, and refuse to resume a different run from it.

A checkpoint of a DPO run loads into an SFT module without error when the parameter names match (both hold
``model.*``), and Lightning then restores the DPO run's optimizer, scheduler and step counter; a checkpoint of an SFT
run on other data loads just as silently. To make that impossible, every checkpoint gets a small record
(``checkpoint["lit_trainer_run"]``):

* ``module``, ``datamodule``: the LightningModule's and the data module's class paths;
* ``run_name``: the run's name (the logger's ``name``; ``sft``, ``dpo``, ``grpo`` by default in ``lit-trainer``);
* ``run_dir``: the folder the run logged to (where a resumed run continues);
* ``config``: the model and data arguments of the run's configuration, flattened to dotted keys;
* ``global_step`` and ``finished`` (the run had reached its ``max_steps``/``max_epochs``).

A checkpoint of another module class, data module class or run name is never resumed. The configuration decides
which checkpoints ``lit-trainer fit --ckpt_path last`` considers the same run: every model and data argument except
the short list :data:`RESUME_MAY_CHANGE` (data loading and validation options); trainer options (``max_steps``,
devices, logging, callbacks) are not part of it (docs/runs_and_resume.md). A checkpoint without a record (written
elsewhere) is loaded with a warning that it could not be checked.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_trainer.checkpoint_load import load_checkpoint

RECORD_KEY = "lit_trainer_run"
_SHARDED_METADATA = "meta.pt"  # the non-tensor part of a sharded checkpoint folder (lightning.fabric's name for it)
IDENTITY_KEYS = ("module", "datamodule", "run_name")

# Configuration keys a resume may change without becoming another run: how data is loaded (not which data) and what
# validation reports. Everything under ``trainer.*`` (max_steps, devices, logging, callbacks, ...) is not part of
# the identity at all. Shell-style patterns over the dotted keys of :func:`flatten_config`.
RESUME_MAY_CHANGE = (
    "data.init_args.num_workers",
    "data.init_args.persistent_workers",
    "data.init_args.prefetch_factor",
    "data.init_args.pin_memory",
    "data.init_args.eval_batch_size",
    "model.init_args.eval_*",
)

Primitive = str | int | float | bool | None


def class_path(obj_or_type: Any) -> str | None:
    """``package.module.Class`` of an object or a class (``None`` for ``None``)."""
    if obj_or_type is None:
        return None
    cls = obj_or_type if isinstance(obj_or_type, type) else type(obj_or_type)
    return f"{cls.__module__}.{cls.__qualname__}"


def same_class(recorded: Any, current: Any) -> bool:
    """Whether two class paths name one class: equal, or both import to the same object.

    A class that moved to another file stays importable from its former path (``lit_trainer.modules.grpo.GRPOModule``
    is ``lit_trainer.modules.grpo.grpo_module.GRPOModule``), so a checkpoint written before the move is still the same
    run. Only two paths ending in the same class name are imported; a path that does not import is compared as text.

    Example:
        >>> same_class("lit_trainer.callbacks.RunIdentity", "lit_trainer.callbacks.run_identity.RunIdentity")
        True
        >>> same_class("a.SFT", "a.GRPO")
        False
    """
    if recorded == current:
        return True
    if not (isinstance(recorded, str) and isinstance(current, str)):
        return False
    if recorded.rpartition(".")[2] != current.rpartition(".")[2]:
        return False  # a moved class keeps its name; nothing is imported for two different names
    found = []
    for path in (recorded, current):
        module_name, _, name = path.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError, ValueError):
            return False
    return isinstance(found[0], type) and found[0] is found[1]


def _plain(value: Any) -> Any:
    """Nested dicts/lists of primitives: jsonargparse namespaces and mappings become dicts, objects their class."""
    if hasattr(value, "as_dict") and callable(value.as_dict):  # jsonargparse.Namespace
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return f"<{class_path(value)}>"  # an object: its class is stable, its repr (addresses, weights) is not


def flatten_config(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Primitive]:
    """Dotted keys to primitive values; a list is one value (its JSON text), an object its class path.

    Example:
        >>> flatten_config({"model": {"class_path": "a.B", "init_args": {"lr": 0.1, "layers": [1, 2]}}})
        {'model.class_path': 'a.B', 'model.init_args.lr': 0.1, 'model.init_args.layers': '[1, 2]'}
    """
    flat: dict[str, Primitive] = {}
    for key, value in _plain(tree).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{name}.") if value else {name: "{}"})
        elif isinstance(value, list):
            flat[name] = json.dumps(value, sort_keys=True)
        else:
            flat[name] = value
    return flat


def retired_options(module: Any) -> dict[str, Primitive]:
    """The configuration keys (``model.init_args.<name>``) of a LightningModule's (class or instance)
    ``RETIRED_OPTIONS``: options its earlier versions took, with the only value they accepted, that a checkpoint's
    run record may still list (e.g. ``RLOOModule``'s former GRPOModule options)."""
    return {f"model.init_args.{name}": value for name, value in getattr(module, "RETIRED_OPTIONS", {}).items()}


def config_differences(
    recorded: Mapping[str, Primitive], current: Mapping[str, Primitive], retired: Mapping[str, Primitive] | None = None
) -> dict[str, tuple]:
    """``{key: (checkpoint value, this run's value)}`` for every identity key that differs.

    Keys matching :data:`RESUME_MAY_CHANGE` are ignored. A key only this run has is an option the checkpoint's
    version of lit_trainer did not have (the configuration lists every argument, defaults included): not a
    difference, so upgrading does not turn a preempted run into a new one. A key only the checkpoint has is compared
    with ``None``, unless ``retired`` (:func:`retired_options`) gives it that value: an option the module no longer
    has, which the checkpoint's version listed at the only value it accepted.

    Example:
        >>> config_differences({"data.init_args.dataset": "a.jsonl"}, {"data.init_args.dataset": "b.jsonl"})
        {'data.init_args.dataset': ('a.jsonl', 'b.jsonl')}
        >>> config_differences({"data.init_args.num_workers": 0}, {"data.init_args.num_workers": 4})
        {}
        >>> config_differences({}, {"model.init_args.new_option": 1})  # an option added since the checkpoint
        {}
    """
    retired = retired or {}
    recorded = {k: v for k, v in recorded.items() if k in current or k not in retired or retired[k] != v}
    keys = sorted(recorded)
    return {
        key: (recorded.get(key), current.get(key))
        for key in keys
        if not _same_value(key, recorded.get(key), current.get(key))
        and not any(fnmatch.fnmatchcase(key, p) for p in RESUME_MAY_CHANGE)
    }


def _same_value(key: str, recorded: Any, current: Any) -> bool:
    """Equal values; for a ``class_path`` key, two paths of one class (:func:`same_class`)."""
    if recorded == current:
        return True
    return key.rpartition(".")[2] == "class_path" and same_class(recorded, current)


def describe_differences(differences: Mapping[str, tuple], limit: int = 6) -> str:
    """``key: checkpoint X, this run Y; ...`` (at most ``limit`` keys, then how many more)."""
    items = [f"{key}: checkpoint {old!r}, this run {new!r}" for key, (old, new) in list(differences.items())[:limit]]
    if len(differences) > limit:
        items.append(f"and {len(differences) - limit} more")
    return "; ".join(items)


def _class_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """``key: checkpoint X, this run Y; ...`` for the :data:`IDENTITY_KEYS` that differ, ``None`` when none does."""
    differences = {key: (recorded.get(key), current.get(key)) for key in IDENTITY_KEYS}
    classes = ("module", "datamodule")
    same = {k for k, (old, new) in differences.items() if old == new or (k in classes and same_class(old, new))}
    return describe_differences({k: v for k, v in differences.items() if k not in same}) or None


def identity_mismatch(recorded: dict[str, Any], current: dict[str, Any], checkpoint: str | os.PathLike) -> str | None:
    """The refusal message when ``recorded`` (from the checkpoint) and ``current`` are different runs, else ``None``.

    Only the classes and the run name are compared here: a checkpoint of another module, data module or run name can
    never be resumed. Configuration differences are :func:`config_differences`.

    Example:
        >>> identity_mismatch({"module": "a.SFT", "run_name": "sft"}, {"module": "a.SFT", "run_name": "sft"}, "x")
        >>> identity_mismatch({"module": "a.GRPO"}, {"module": "a.SFT"}, "x.ckpt")[:60]
        'Refusing to resume from x.ckpt: it was written by another ru'
    """
    details = _class_differences(recorded, current)
    if details is None:
        return None
    return (
        f"Refusing to resume from {checkpoint}: it was written by another run ({details}). Resume it with the "
        "same module, data module and run name, or start a fresh run without --ckpt_path (from Python: "
        "ckpt_path=None)."
    )


def limit_reached(step: int, epochs_done: int, max_steps: int | None, max_epochs: int | None) -> bool:
    """Whether a run at ``step`` with ``epochs_done`` complete epochs has reached its ``max_steps``/``max_epochs``.

    Example:
        >>> limit_reached(20, 0, 20, None), limit_reached(19, 0, 20, None), limit_reached(7, 1, -1, 1)
        (True, False, True)
    """
    by_steps = max_steps is not None and max_steps >= 0 and step >= max_steps
    return by_steps or (max_epochs is not None and max_epochs >= 0 and epochs_done >= max_epochs)


def read_record(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The run record of a checkpoint, or ``None`` when it has none.

    A file is memory-mapped, so only the small record is actually read; a sharded checkpoint folder (Lightning's
    ``ModelParallelStrategy`` / FSDP2) keeps it in its ``meta.pt``, the non-tensor part of the checkpoint. Loaded with
    :func:`lit_trainer.checkpoint_load.load_checkpoint` (no arbitrary code runs before the user's own ``fit`` loads it;
    hyperparameters ``weights_only`` refuses are left unbuilt); a checkpoint that still cannot be read is reported as
    having no record here, and :class:`RunIdentity` still checks it when ``fit`` loads it.
    """
    path = os.path.join(checkpoint, _SHARDED_METADATA) if os.path.isdir(checkpoint) else checkpoint
    if not os.path.isfile(path):
        return None
    try:
        state = load_checkpoint(path, mmap=True)
    except (pickle.UnpicklingError, RuntimeError):
        return None
    return state.get(RECORD_KEY)


def not_continued_because(record: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """Why ``--ckpt_path last`` does not continue the checkpoint with ``record`` (``None``: it continues it).

    ``current`` is this run's ``module``, ``datamodule``, ``run_name``, flattened ``config`` and optionally the
    module's ``retired`` keys (:func:`retired_options`). A record written before configurations were recorded (no
    ``config``) is compared on the classes and the run name only.
    """
    if not record:
        return "it has no lit_trainer run record, so whether it is this run cannot be checked"
    if (details := _class_differences(record, current)) is not None:
        return f"it belongs to another run ({details})"
    differences = config_differences(record.get("config", {}), current.get("config", {}), current.get("retired"))
    if "config" in record and differences:
        return f"its configuration differs ({describe_differences(differences)})"
    if record.get("finished"):
        return f"that run finished: step {record.get('global_step')} reached its max_steps/max_epochs"
    return None


def pick_last(checkpoints: Sequence[str], current: Mapping[str, Any]) -> tuple[str | None, list[tuple[str, str]]]:
    """The checkpoint ``--ckpt_path last`` continues, and the runs it passed over with the reason.

    Each run folder counts once, by its newest checkpoint: a run whose newest checkpoint is finished is finished,
    even though its earlier periodic checkpoints are not.

    Args:
        checkpoints: complete checkpoints, newest first.
        current: see :func:`not_continued_because`.

    Returns:
        ``(path or None, [(path, reason), ...])``.
    """
    seen: set[str] = set()
    skipped: list[tuple[str, str]] = []
    for path in checkpoints:
        record = read_record(path)
        run_dir = (record or {}).get("run_dir") or os.path.dirname(os.path.dirname(os.path.abspath(path)))
        if os.path.abspath(run_dir) in seen:
            continue
        seen.add(os.path.abspath(run_dir))
        reason = not_continued_because(record, current)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


class RunIdentity(Callback):
    """Write the run record into every checkpoint; refuse ``fit(ckpt_path=...)`` from another run's checkpoint.

    ``lit-trainer`` adds it to every run (with ``config`` = the model and data sections of the run's configuration).
    Works with any LightningModule.

    The record (``checkpoint["lit_trainer_run"]``, primitives only): ``module``, ``datamodule`` (class paths),
    ``run_name``, ``run_dir`` (the folder the run logged to), ``config`` (dotted keys, see :func:`flatten_config`),
    ``global_step``, and ``finished``: whether the run had reached its ``max_steps``/``max_epochs`` when the
    checkpoint was written (``--ckpt_path last`` never continues a finished run).

    On load, another module class, data module class or run name is refused (``ValueError``); configuration keys
    that differ (outside :data:`RESUME_MAY_CHANGE`) are reported with a warning, since an explicit checkpoint path
    is how a user continues a run with a changed configuration on purpose.

    Args:
        run_name: the run's name; ``None`` takes the first logger's ``name`` (``None`` without a logger).
        config: the run's configuration as a nested mapping (``{"model": {...}, "data": {...}}``); ``None``
            records the LightningModule's and data module's ``hparams`` under ``model.``/``data.``.

    Example::

        trainer = Trainer(callbacks=[RunIdentity()], logger=CSVLogger("runs", name="sft"))
        trainer.fit(module, datamodule=dm, ckpt_path="runs/dpo/version_0/checkpoints/last.ckpt")  # ValueError
    """

    def __init__(self, run_name: str | None = None, config: Mapping[str, Any] | None = None) -> None:
        self.run_name = run_name
        self.config = None if config is None else flatten_config(config)

    def current(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """This run's record (without the step and the finished flag)."""
        logger = trainer.loggers[0] if trainer.loggers else None
        datamodule = getattr(trainer, "datamodule", None)
        config = self.config
        if config is None:
            hparams = {"model": dict(pl_module.hparams), "data": dict(getattr(datamodule, "hparams", {}))}
            config = flatten_config(hparams)
        return {
            "module": class_path(pl_module),
            "datamodule": class_path(datamodule),
            "run_name": self.run_name if self.run_name is not None else getattr(logger, "name", None),
            "run_dir": getattr(logger, "log_dir", None),  # not trainer.log_dir: that one is a collective
            "config": config,
        }

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        loop = trainer.fit_loop
        # `processed` counts the epoch whose end hooks are running (where end-of-epoch checkpoints are written)
        epochs = loop.epoch_progress.current.processed
        checkpoint[RECORD_KEY] = {
            **self.current(trainer, pl_module),
            "global_step": trainer.global_step,
            "finished": limit_reached(trainer.global_step, epochs, trainer.max_steps, trainer.max_epochs),
        }

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
        current = self.current(trainer, pl_module)
        message = identity_mismatch(recorded, current, where)
        if message is not None:
            raise ValueError(message)
        retired = retired_options(pl_module)
        if "config" in recorded and (differences := config_differences(recorded["config"], current["config"], retired)):
            rank_zero_warn(
                f"Resuming {where} with a changed configuration ({describe_differences(differences)}): the run "
                "continues with this run's values."
            )
