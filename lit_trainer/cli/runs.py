"""Where a run writes: ``<root>/<run name>/version_<n>/``, one folder per run (see ``docs/runs_and_resume.md``).

* ``root`` is ``trainer.default_root_dir`` (``runs`` by default): logs, checkpoints and the HF export all go below it.
* the run name is ``--run_name``, else derived from the LightningModule class (:func:`default_run_name`), so SFT,
  DPO and GRPO runs never interleave in one folder;
* a fresh run takes the next free ``version_<n>`` and never writes into a folder that already holds files
  (:func:`fresh_version`); a resumed run continues in the folder its checkpoint came from (:func:`version_of`);
* ``fit`` reserves its folder at once, by creating it (:func:`reserve_version`): ``mkdir`` either creates a folder
  or fails because it exists, atomically, so runs started at the same instant (a sweep, two terminals) each get
  their own ``version_<n>``; the other processes of a multi-process run take rank 0's folder (:data:`RUN_DIR_ENV`).
"""

from __future__ import annotations

import csv
import errno
import importlib
import os
import shutil
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from lit_trainer.core.atomic import atomic_write
from lit_trainer.core.version_folders import version_folder, version_number

DEFAULT_ROOT = "runs"
# Rank 0 of a fit names the folder it reserved here; the processes Lightning starts for the other ranks inherit the
# environment, so they log to (and look for checkpoints in) the same folder instead of reserving one of their own.
RUN_DIR_ENV = "LIT_TRAINER_RUN_DIR"
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


def default_run_name(module_class_path: str) -> str:
    """The run name of a LightningModule class when ``--run_name`` is not given: the ``RUN_NAME`` the class itself
    declares (ours: ``sft``, ``dpo``, ``grpo``, ``reward``, ``kto``, ``orpo``, ``cpo``, ``rloo``, ``distill``), else
    the class name in lower case.

    Only the class's own declaration counts, not one it inherits: a user's ``MyDPO(DPOModule)`` writes to ``mydpo``,
    not into the ``dpo`` runs of the class it extends.

    Example:
        >>> default_run_name("lit_trainer.DPOModule"), default_run_name("my.pkg.MyNet")
        ('dpo', 'mynet')
    """
    module_path, _, class_name = module_class_path.rpartition(".")
    try:
        module_class = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError, ValueError):  # LightningCLI refuses the path itself, with its own message
        import lit_trainer  # a path that cannot be imported here but names one of ours by its class: its run name

        module_class = getattr(lit_trainer, class_name) if class_name in lit_trainer.__all__ else None
    declared = vars(module_class).get("RUN_NAME") if isinstance(module_class, type) else None
    return declared or class_name.lower()


def next_version(run_root: str | os.PathLike) -> int:
    """One past the highest ``version_<n>`` in ``run_root`` (``0`` when there is none)."""
    taken = [n for p in Path(run_root).glob("version_*") if (n := version_number(p.name)) is not None]
    return max(taken, default=-1) + 1


def _holds_files(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def fresh_version(run_root: str | os.PathLike, pinned: int | str | None) -> tuple[int | str, str | None]:
    """The version a fresh (not resumed) run writes to, and a note when the pinned one had to be skipped.

    A version pinned by a config (``--print_config`` output, or the ``config.yaml`` a run saved) is used only while
    its folder is empty: re-running a saved config starts a new version instead of overwriting the earlier run.

    Args:
        run_root: ``<root>/<run name>``.
        pinned: the logger's ``version`` from the config (``None``: not pinned).

    Returns:
        ``(version, note)``: an int means ``version_<int>``; ``note`` is ``None`` unless the pinned one was skipped.

    Example:
        >>> fresh_version("/nonexistent/sft", None)
        (0, None)
    """
    if pinned is not None and not _holds_files(Path(run_root) / version_folder(pinned)):
        return (version_number(pinned) if version_number(pinned) is not None else pinned), None
    chosen = next_version(run_root)
    if pinned is None:
        return chosen, None
    return chosen, (
        f"{Path(run_root) / version_folder(pinned)} already holds an earlier run; this run writes to "
        f"{Path(run_root) / version_folder(chosen)} instead, so nothing is overwritten (pass --ckpt_path to "
        "continue that run)."
    )


def reserve_version(run_root: str | os.PathLike, pinned: int | str | None) -> tuple[int | str, str | None]:
    """Like :func:`fresh_version`, and the folder is created before this returns, so no other run can take it.

    ``os.mkdir`` of a folder that exists fails, atomically, so of several runs started at the same instant each
    creates a different ``version_<n>``: one that finds its candidate just taken moves on to the next number. A
    pinned version is used only when this call creates its folder: an existing folder, even an empty one, may have
    just been taken by a run started at the same instant with the same saved config.

    Args:
        run_root: ``<root>/<run name>`` (created when missing).
        pinned: the logger's ``version`` from the config (``None``: not pinned).

    Returns:
        ``(version, note)`` as :func:`fresh_version`.

    Raises:
        PermissionError: ``run_root`` cannot be written (no permission, a read-only file system); the message
            names the folder and the option that moves it.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp()) / "sft"
        >>> reserve_version(root, None), reserve_version(root, None), sorted(p.name for p in root.iterdir())
        ((0, None), (1, None), ['version_0', 'version_1'])
    """
    run_root = Path(run_root)
    try:
        run_root.mkdir(parents=True, exist_ok=True)
        if pinned is not None and _try_mkdir(run_root / version_folder(pinned)):
            return (version_number(pinned) if version_number(pinned) is not None else pinned), None
        while not _try_mkdir(run_root / version_folder(version := next_version(run_root))):
            pass  # taken by a run started at the same instant: the next number
    except OSError as error:
        if error.errno not in _NOT_WRITABLE:
            raise
        raise PermissionError(
            f"Cannot create the run folder in {run_root}: {error.strerror.lower() if error.strerror else error}. "
            "Runs are written under --trainer.default_root_dir (default: ./runs); point it at a folder you can write "
            f"to, e.g. --trainer.default_root_dir $HOME/runs."
        ) from None
    if pinned is None:
        return version, None
    # the pinned folder exists (an earlier run's, or, even empty, one a run started at the same instant with the same
    # saved config has just taken): this run takes the next free number
    return version, (
        f"{run_root / version_folder(pinned)} is taken (an earlier run, or one started at the same time); this run "
        f"writes to {run_root / version_folder(version)} instead, so nothing is overwritten (pass --ckpt_path to "
        "continue that run)."
    )


def _try_mkdir(folder: Path) -> bool:
    try:
        folder.mkdir()
    except FileExistsError:
        return False
    return True


def version_of(
    checkpoint: str | os.PathLike, run_root: str | os.PathLike, run_dir: str | None = None
) -> int | str | None:
    """The version folder of ``run_root`` that a checkpoint belongs to, or ``None`` when it is not in one.

    ``run_dir`` (the folder the run that wrote the checkpoint logged to, recorded in the checkpoint) wins; otherwise
    the checkpoint's own location ``<run_root>/version_<n>/checkpoints/<file>`` is used.
    """
    root = Path(run_root).resolve()
    candidates = [Path(run_dir)] if run_dir else []
    candidates.append(Path(checkpoint).resolve().parent.parent)
    for folder in candidates:
        if folder.resolve().parent == root:
            number = version_number(folder.name)
            return number if number is not None else folder.name
    return None


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued instead of deleted."""

    @override
    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as file:
                self.metrics_keys = sorted(next(csv.reader(file), []))


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` survives a resume: a resumed run appends its rows to the same curve.

    Lightning's ``CSVLogger`` deletes ``metrics.csv`` when its folder is not empty ("Previous log files ... will be
    deleted"), which would erase the first part of a resumed run. Fresh runs never share a folder (see
    :func:`fresh_version`), so appending is safe.
    """

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def rewind(self, step: int) -> None:
        """Before a resume from a checkpoint at global step ``step``: drop the rows the interrupted part logged at
        steps ``>= step`` (after its checkpoint: the resumed run logs those steps again), so each step has one row.
        The same rule as :meth:`lit_trainer.loggers.TrackioLogger.rewind`."""
        if self._experiment is not None:
            self._experiment.save()
        drop_rows_from(Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE, int(step))


def drop_rows_from(metrics_file: Path, step: int) -> int:
    """Remove the rows of a ``metrics.csv`` whose ``step`` is ``>= step`` (rewritten atomically); returns how many."""
    if not metrics_file.is_file():
        return 0
    with open(metrics_file, newline="") as file:
        reader = csv.DictReader(file)
        header, rows = reader.fieldnames or [], list(reader)
    kept = [row for row in rows if not row.get("step") or int(float(row["step"])) < step]
    if len(kept) == len(rows):
        return 0
    with atomic_write(metrics_file) as partial, open(partial, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=header)
        writer.writeheader()
        writer.writerows(kept)
    return len(rows) - len(kept)


# files a resumed part rewrites in the run folder: its records, and metrics.csv, which a resume rewinds to the
# checkpoint's step (a resume from an earlier checkpoint of a longer run would otherwise lose the rows after it)
PART_RECORDS = ("config.yaml", "hparams.yaml", "metrics.csv")
PARTS_FOLDER = "parts"


def keep_part_records(run_dir: str | os.PathLike) -> Path | None:
    """Copy the records of the run's latest part into ``<run_dir>/parts/part_<k>/`` before a resumed part rewrites them.

    ``config.yaml`` and ``hparams.yaml`` at the top of a run folder always describe its latest part; each earlier
    part's copies are kept under ``parts/part_0``, ``parts/part_1``, ... ``metrics.csv`` is continued, but first
    rewound to the checkpoint's step (each step once), so the rows as they were before the resume are kept there
    too: resuming from an earlier checkpoint of a longer run loses no logged history. Returns the new folder, or
    ``None`` when there was nothing to keep.

    Example:
        >>> keep_part_records("/nonexistent") is None
        True
    """
    run_dir = Path(run_dir)
    present = [run_dir / name for name in PART_RECORDS if (run_dir / name).is_file()]
    if not present:
        return None
    parts = run_dir / PARTS_FOLDER
    taken = [int(p.name.removeprefix("part_")) for p in parts.glob("part_*") if p.name.removeprefix("part_").isdigit()]
    target = parts / f"part_{max(taken, default=-1) + 1}"
    target.mkdir(parents=True)
    for path in present:
        shutil.copy2(path, target / path.name)
    return target


class RunFolderState:
    """What a run folder holds before a resumed part writes into it, to put it back if that part is refused.

    A resumed part rewrites the run's records (:data:`PART_RECORDS`: ``config.yaml``, ``hparams.yaml``, the rewound
    ``metrics.csv``), copies the earlier ones to ``parts/part_<k>/`` and opens new logs (a TensorBoard events file).
    When the resume is refused before the part trains its first step (another run's checkpoint, an argument or a file
    a check refuses, a callback that refuses the checkpoint), :meth:`restore` undoes all of it: the records get their
    bytes and modification times back, and every file and folder that was not there is removed, so the folder still
    describes the run that trained.

    Example:
        >>> import tempfile
        >>> run = Path(tempfile.mkdtemp())
        >>> _ = (run / "config.yaml").write_text("lr: 0.1")
        >>> state = RunFolderState(run)
        >>> _ = (run / "config.yaml").write_text("lr: 0.2"); (run / "parts").mkdir()
        >>> state.restore(), (run / "config.yaml").read_text(), sorted(p.name for p in run.iterdir())
        (True, 'lr: 0.1', ['config.yaml'])
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.paths = {p.relative_to(self.run_dir) for p in self.run_dir.rglob("*")}
        self.records: dict[str, tuple[bytes, int, int]] = {}
        for name in PART_RECORDS:
            path = self.run_dir / name
            if path.is_file():
                info = path.stat()
                self.records[name] = (path.read_bytes(), info.st_atime_ns, info.st_mtime_ns)

    def restore(self) -> bool:
        """Put the records back and remove what was added; returns whether anything had changed."""
        changed = False
        for name, (data, atime, mtime) in self.records.items():
            path = self.run_dir / name
            if path.is_file() and path.read_bytes() == data and path.stat().st_mtime_ns == mtime:
                continue
            with atomic_write(path) as partial:
                partial.write_bytes(data)
            os.utime(path, ns=(atime, mtime))
            changed = True
        added = [p for p in self.run_dir.rglob("*") if p.relative_to(self.run_dir) not in self.paths]
        for path in sorted(added, key=lambda p: len(p.parts)):  # a new folder goes with its content
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists() or path.is_symlink():
                path.unlink()
            changed = True
        return changed


def remove_unused_run_folder(run_dir: str | os.PathLike) -> bool:
    """Delete a fresh run's folder after it failed before its first optimizer step, unless it holds a checkpoint.

    Such a folder holds at most a ``config.yaml``, an ``hparams.yaml`` and empty logs: keeping it would only push
    the next run to another version number. Returns whether it was removed.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or any(p.suffix == ".ckpt" for p in run_dir.rglob("*")):
        return False
    shutil.rmtree(run_dir)
    return True
