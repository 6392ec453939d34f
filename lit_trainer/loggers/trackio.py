"""TrackioLogger: a Lightning logger for Trackio, Hugging Face's local-first experiment tracker.

Trackio (``pip install "lit_trainer[trackio]"``) keeps every project in a local SQLite file (under ``TRACKIO_DIR``,
by default ``~/.cache/huggingface/trackio``) and shows it with ``trackio show``; it needs no account and no server.
This logger only ever writes to that local store: it never creates or syncs to a Hugging Face Space, and no Hub
request is made while a run starts (``trackio sync`` publishes a project later, on purpose).

One Trackio run per run folder: the run's project, name and id are recorded in ``<log_dir>/trackio_run.json``, so a
run resumed in its folder (``lit-trainer fit --ckpt_path last``) continues the same Trackio run. Rows the interrupted
part logged after its checkpoint are dropped on resume (:meth:`TrackioLogger.rewind`), so each step appears once.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sqlite3
from argparse import Namespace
from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict, _sanitize_callable_params
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

from lit_trainer.core.version_folders import version_folder

RECORD_FILE = "trackio_run.json"
DEFAULT_PROJECT = "lit_trainer"
INSTALL_HINT = 'pip install "lit_trainer[trackio]"'
# Environment variables that would send a trackio run to a Space or a server instead of the local store
_REMOTE_ENV = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")

Resume = Literal["auto", "allow", "never", "must"]


def import_trackio() -> Any:
    """The ``trackio`` module, or an ``ImportError`` that says how to install it."""
    try:
        return importlib.import_module("trackio")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"TrackioLogger (--report_to trackio) needs the `trackio` package: {INSTALL_HINT}"
        ) from error


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """While it is open, trackio sees no Space or server variable and the Hub client refuses every request.

    ``trackio.init`` asks the Hub who the user is (``whoami``) when a Hugging Face token is present, only to label
    the run; in offline mode that question fails at once and the label is left empty.
    """
    import huggingface_hub.constants as hub

    saved = {key: os.environ.pop(key) for key in _REMOTE_ENV if key in os.environ}
    offline = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = offline
        os.environ.update(saved)


def _scalar(value: Any) -> Any:
    """A tensor or numpy scalar as a Python number; anything else unchanged."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        return item()
    return value


def unreserved_key(key: str, taken: Container[str] = ()) -> str:
    """The config key trackio accepts for ``key``: ``key`` itself, unless it starts with ``_``.

    trackio reserves config keys that start with ``_`` (its own ``_Username``, ``_Created``, ``_Group``):
    ``trackio.init`` refuses them, and its dashboard hides them. Such a key loses its leading underscores
    (hydra's ``_target_`` becomes ``target_``); when that name is in ``taken`` (another key of the config), the
    first free of ``-2``, ``-3``, ... is appended (``target_-2``). A key of underscores only becomes ``param``.
    Only the first character matters: a flattened nested key (``model/_target_``) is kept.

    Example:
        >>> unreserved_key("_target_"), unreserved_key("_target_", {"target_"}), unreserved_key("model/_target_")
        ('target_', 'target_-2', 'model/_target_')
    """
    if not key.startswith("_"):
        return key
    stem = key.lstrip("_") or "param"
    candidate, k = stem, 1
    while candidate in taken:
        k += 1
        candidate = f"{stem}-{k}"
    return candidate


class _TrackioLogger:
    """The implementation of :class:`TrackioLogger`, without a Lightning base (one class per Lightning package)."""

    def __init__(
        self,
        project: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        save_dir: str | os.PathLike | None = None,
        name: str | None = None,
        version: int | str | None = None,
        resume: Resume = "auto",
        group: str | None = None,
        log_system_metrics: bool = False,
    ) -> None:
        super().__init__()  # the Lightning Logger base
        if resume not in ("auto", "allow", "never", "must"):
            raise ValueError(f"TrackioLogger: resume={resume!r}; use 'auto', 'allow', 'never' or 'must'.")
        self._project = project or os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT
        self._run_name = run_name
        self._renamed: dict[str, str] = {}  # reserved config key -> the name it is stored under
        self._config: dict[str, Any] = {}
        self._config = self._unreserved(dict(config or {}))
        self._save_dir = None if save_dir is None else os.fspath(save_dir)
        self._name = name
        self._version = version
        self._resume = resume
        self._group = group
        self._log_system_metrics = log_system_metrics
        self._run: Any = None
        self._rewind_step: int | None = None

    @property
    @override
    def name(self) -> str:
        """The run name (the folder under ``save_dir``), else the project."""
        return self._name or self._project

    @property
    @override
    def version(self) -> int | str | None:
        return self._version

    @property
    @override
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    @override
    def log_dir(self) -> str | None:
        """The run folder, ``save_dir/name/version_<n>`` (``None`` without ``save_dir``)."""
        if self._save_dir is None:
            return None
        parts = [self._save_dir, self.name] + ([version_folder(self._version)] if self._version is not None else [])
        return os.path.join(*parts)

    @property
    def project(self) -> str:
        """The Trackio project the run is (or will be) in."""
        return self._project

    @property
    def run_name(self) -> str | None:
        """The Trackio run's name once the run has started, else the name it will ask for (``None``: generated)."""
        if self._run is not None:
            return self._run.name
        return self._run_name or self._default_run_name()

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The ``trackio.Run`` (started on first use, on global rank 0 only)."""
        if self._run is None:
            self._run = self._start()
        return self._run

    def _default_run_name(self) -> str | None:
        if self._name is None:
            return None
        if self._version is None:
            return self._name
        return f"{self._name}-{version_folder(self._version)}"

    def _record_path(self) -> Path | None:
        return None if self.log_dir is None else Path(self.log_dir) / RECORD_FILE

    def _read_record(self) -> dict[str, Any] | None:
        path = self._record_path()
        if path is None or not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            rank_zero_warn(f"TrackioLogger: {path} cannot be read; this run starts a new Trackio run.")
            return None
        return record if isinstance(record, dict) and record.get("run_name") else None

    def _start(self) -> Any:
        trackio = import_trackio()
        record = self._read_record() if self._resume == "auto" else None
        if record is not None:
            project, run_name, resume = record.get("project") or self._project, record["run_name"], "allow"
            if project != self._project:
                rank_zero_info(f"[lit_trainer] Trackio: the run folder's run is in project '{project}'; continuing it")
            self._project = project
        else:
            run_name = self._run_name or self._default_run_name()
            resume = "never" if self._resume == "auto" else self._resume
            if run_name is not None and resume == "never":
                run_name = self._free_name(trackio, run_name)
        system = None if self._log_system_metrics else False
        with local_only():
            run = trackio.init(
                project=self._project,
                name=run_name,
                group=self._group,
                config=self._config,
                resume=resume,
                embed=False,
                auto_log_cpu=system,
                auto_log_gpu=system,
            )
        if record is not None and record.get("run_id") not in (None, run.id):
            rank_zero_warn(
                f"TrackioLogger: the run folder records Trackio run id {record.get('run_id')}, but project "
                f"'{self._project}' now continues '{run_name}' as {run.id} (the recorded run is gone or renamed)."
            )
        path = self._record_path()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"project": self._project, "run_name": run.name, "run_id": run.id}) + "\n")
        if self._rewind_step is not None:
            self._delete_rows_from(run, self._rewind_step)
        return run

    def _free_name(self, trackio: Any, run_name: str) -> str:
        """``run_name``, or ``run_name-2``, ``-3``, ... when the project already has a run of that name."""
        try:
            taken = set(trackio.SQLiteStorage.get_runs(self._project))
        except Exception:  # an unreadable store: trackio reports it itself when it opens it
            return run_name
        candidate, k = run_name, 1
        while candidate in taken:
            k += 1
            candidate = f"{run_name}-{k}"
        return candidate

    @rank_zero_only
    def rewind(self, step: int) -> None:
        """Make ``step`` the first step this run logs again: rows at steps ``>= step`` are removed from the store.

        For a resume from a checkpoint at global step ``G``: Lightning's logger step of the ``G+1``-th optimizer
        step is ``G``, so ``rewind(G)`` removes exactly what the interrupted part logged after the checkpoint (those
        steps are trained and logged again); rows up to the checkpoint are kept. Applied when the run starts (or at
        once if it has started).
        """
        self._rewind_step = int(step)
        if self._run is not None:
            self._delete_rows_from(self._run, self._rewind_step)

    def _delete_rows_from(self, run: Any, step: int) -> None:
        trackio = import_trackio()
        db_path = trackio.SQLiteStorage.get_project_db_path(run.project)
        if not Path(db_path).is_file():
            return
        try:
            with contextlib.closing(sqlite3.connect(db_path, timeout=30)) as conn, conn:
                deleted = conn.execute("DELETE FROM metrics WHERE run_id = ? AND step >= ?", (run.id, step)).rowcount
        except sqlite3.Error as error:
            rank_zero_warn(f"TrackioLogger: could not remove the rows after step {step} of run '{run.name}': {error}")
            return
        if deleted:
            rank_zero_info(
                f"[lit_trainer] Trackio run '{run.name}': {deleted} row(s) logged after the checkpoint "
                f"(step >= {step}) were removed; the resumed run logs those steps again"
            )

    def _unreserved(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with the keys trackio reserves renamed (:func:`unreserved_key`), the same name for the same
        key in every call; says once which keys were renamed."""
        taken = set(self._config) | {key for key in params if not key.startswith("_")}
        config: dict[str, Any] = {}
        renamed: list[str] = []
        for key, value in params.items():
            if key.startswith("_"):
                if key not in self._renamed:
                    self._renamed[key] = unreserved_key(key, taken)
                    renamed.append(f"{key} -> {self._renamed[key]}")
                taken.add(self._renamed[key])
                config[self._renamed[key]] = value
            else:
                config[key] = value
        if renamed:
            rank_zero_info(
                "[lit_trainer] Trackio reserves config keys that start with '_'; stored renamed: " + ", ".join(renamed)
            )
        return config

    @override
    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Add ``params`` (flattened with ``/``) to the run's config.

        Keys that trackio reserves (they start with ``_``, as hydra's ``_target_``) are renamed by
        :func:`unreserved_key` (``_target_`` -> ``target_``), inside ``fit`` or not.
        """
        params = _sanitize_callable_params(_flatten_dict(_convert_params(params)))
        params = self._unreserved({key: _scalar(value) for key, value in params.items()})
        self._config.update(params)
        if self._run is not None:
            self._run.config.update(params)
            if hasattr(self._run, "_config_logged"):  # trackio stores the config with the next row
                self._run._config_logged = False

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` at ``step`` (tensors become numbers)."""
        self.experiment.log({key: _scalar(value) for key, value in metrics.items()}, step=step)

    @rank_zero_only
    def log_table(
        self,
        key: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
    ) -> None:
        """Log a table (``trackio.Table``) under ``key``: ``columns`` and row-major ``data``, or a ``dataframe``.

        The signature follows Lightning's ``WandbLogger.log_table``, so code that logs completions or predictions
        with ``logger.log_table(key=..., columns=..., data=..., step=...)`` works with either logger.
        """
        trackio = import_trackio()
        self.experiment.log({key: trackio.Table(columns=columns, data=data, dataframe=dataframe)}, step=step)

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Finish the run (flushes its rows to the store); a later log starts it again, continuing the same run."""
        if self._run is None:
            return
        run, self._run = self._run, None
        run.finish()
        trackio = import_trackio()
        if trackio.context_vars.current_run.get() is run:
            trackio.context_vars.current_run.set(None)
        self._resume = "auto" if self._record_path() is not None else "allow"  # the same run, if it logs again
        self._run_name = run.name
        self._rewind_step = None


class TrackioLogger(_TrackioLogger, Logger):
    """Log metrics, hyper-parameters and tables to a local Trackio project (no network, no account).

    Metrics go to the run's rows at Lightning's step; hyper-parameters become the run's config (a key trackio
    reserves, one that starts with ``_`` like hydra's ``_target_``, is stored without its leading underscores:
    ``target_``, see :func:`unreserved_key`); ``finalize`` (the end of ``fit``, also after an error) finishes the
    run and flushes it. Only global rank 0 writes (DDP, FSDP2): the other ranks never open the store.

    Which Trackio run: with ``save_dir`` and ``name`` the logger owns the folder ``save_dir/name/version_<n>`` (the
    run folder in ``lit-trainer``), where it records the run's project, name and id (``trackio_run.json``). When
    the record exists (a resumed run continues in its folder) the recorded run is continued; otherwise a new run is
    created, named ``<name>-version_<n>`` (``sft-version_3``), or ``run_name``; a name already taken in the project
    gets a ``-2``, ``-3``, ... suffix, so a run name is one run.

    On resume, call :meth:`rewind` with the checkpoint's global step before ``fit`` (``lit-trainer`` does it): the
    rows the interrupted part logged after that checkpoint are removed, and the resumed part logs them again, so a
    chart has each step once.

    Args:
        project: the Trackio project; default the ``TRACKIO_PROJECT`` environment variable, else ``"lit_trainer"``.
        run_name: the Trackio run's name (see above for the default).
        config: extra config entries for the run, next to the hyper-parameters Lightning logs. Keys that trackio
            reserves (a leading ``_``) are renamed, as the hyper-parameters' (:func:`unreserved_key`).
        save_dir: the root of the run folders (``trainer.default_root_dir``); ``None``: no run record is kept.
        name: the run name (the folder under ``save_dir``; Lightning's logger ``name``).
        version: the version folder (``3`` or ``"version_3"``); ``None`` means ``save_dir/name`` itself.
        resume: ``"auto"``: continue the run recorded in the run folder, else a new run; ``"allow"``, ``"must"``,
            ``"never"``: trackio's meaning for the run named ``run_name``.
        group: an optional Trackio group to show related runs together.
        log_system_metrics: also let trackio sample CPU/GPU usage in the background (off: the store holds what the
            training loop logs and nothing else).

    Raises:
        ModuleNotFoundError: ``trackio`` is not installed (when the run starts; the message says how to install it).
        ValueError: ``resume`` is not one of the four values.

    Example::

        from lightning.pytorch import Trainer
        from lit_trainer.loggers import TrackioLogger

        trainer = Trainer(logger=TrackioLogger(project="addition", save_dir="runs", name="sft"), max_steps=100)
        # then `trackio show --project addition`
    """
