"""``lit-trainer``: a LightningCLI with LLM-friendly defaults.

What it changes from a plain ``LightningCLI``:

* model and data classes are chosen by ``class_path`` (``--model=lit_trainer.DPOModule``), and the model's name or
  path is linked to the data module's ``tokenizer``, so they never disagree;
* optimizers and schedulers are injected into the module (``OptimizerCallable``/``LRSchedulerCallable``, trainable
  parameters only, stepped per optimizer step); the CLI's automatic ``--optimizer`` is off;
* a fixed default seed (1234) instead of a random one, so a rerun or resume is reproducible;
* one run = one folder: ``<trainer.default_root_dir (runs)>/<run_name (sft|dpo|grpo|reward)>/version_<n>/`` holds the
  CSV (and TensorBoard) logs, ``config.yaml``, ``checkpoints/`` and ``hf_model/``; a fresh run never writes into a
  folder that holds files, a resumed run continues in its checkpoint's folder (:mod:`lit_trainer.cli.runs`);
* ``--ckpt_path last`` resumes the newest complete checkpoint of an unfinished run with this run name AND the same
  model and data arguments (:class:`~lit_trainer.callbacks.RunIdentity`); a checkpoint of another module, data
  module or run name is refused even as an explicit path; a resumed part never overwrites the records of the earlier
  parts (:func:`lit_trainer.cli.runs.keep_part_records`);
* a fresh run that fails before its first optimizer step removes the run folder it made; a resume refused before
  its first optimizer step leaves the run folder as it was: ``config.yaml`` and the other records byte for byte, no
  new file (:class:`lit_trainer.cli.runs.RunFolderState`);
* every checkpoint is written atomically (:class:`lit_trainer.checkpoint_io.AtomicCheckpointIO`); a checkpoint or
  export that does not fit on the disk is reported in one line with the folder, the space needed and free, and the
  command that continues the run (:func:`main`);
* ``--report_to trackio,tensorboard`` chooses experiment trackers by name next to the run's CSV log
  (:mod:`lit_trainer.cli.trackers`); a resumed run continues its Trackio run without duplicated steps;
* every ``fit`` draws its curves to ``curves.png`` in the run folder
  (:class:`~lit_trainer.callbacks.CurvesPlot`);
* after a ``JITCheckpoint`` stop (SIGTERM, Ctrl-C) the command to continue the run is printed;
* no sanity-check validation by default (generation-based validation is costly and its result is thrown away);
* ``fit`` refuses to run without a bound (``max_steps``, ``max_epochs`` or ``max_time``);
* a final metrics table, plain progress lines when stdout is not a terminal, a warning when CPU threads are
  oversubscribed (:mod:`lit_trainer.callbacks.progress`, :mod:`lit_trainer.cli.cpu_threads`);
* parse errors lead with the actionable line and suggest close option names (:mod:`lit_trainer.cli.errors`).
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lit_trainer.callbacks.curves import CurvesPlot
from lit_trainer.callbacks.progress import FinalMetrics, default_progress_bar
from lit_trainer.callbacks.resume_choice import checked_checkpoint, complete_checkpoints, resolve_resume
from lit_trainer.callbacks.run_identity import (
    RunIdentity,
    class_path,
    flatten_config,
    identity_mismatch,
    pick_last,
    read_record,
    retired_options,
)
from lit_trainer.checkpoint_io import with_atomic_writes
from lit_trainer.cli.cpu_threads import CPUThreadCheck
from lit_trainer.cli.errors import (
    TRACEBACK_ENV,
    FriendlyParser,
    exit_with_message,
    friendly_value_error,
    join_negative_numbers,
    raised_by_our_checks,
)
from lit_trainer.cli.noise import (
    hub_kernel_note,
    quiet_frozen_eval_mode_warning,
    quiet_progress_bars_off_terminal,
    quiet_startup_noise,
)
from lit_trainer.cli.runs import (
    DEFAULT_ROOT,
    RUN_DIR_ENV,
    RunFolderState,
    default_run_name,
    fresh_version,
    keep_part_records,
    remove_unused_run_folder,
    reserve_version,
    version_of,
)
from lit_trainer.cli.trackers import REPORT_TO_HELP, parse_report_to, place_remote_trackers, tracker_loggers
from lit_trainer.core.atomic import NoSpaceError
from lit_trainer.core.version_folders import version_folder, version_number
from lit_trainer.data.base import BaseDataModule
from lit_trainer.modules.base import BaseModule

DEFAULT_SEED = 1234
_RUN_LOGGERS = ("RunCSVLogger", "CSVLogger", "TensorBoardLogger", "TrackioLogger")  # placed in the run folder
# Lightning's CSVLogger deletes the metrics.csv of a folder it finds in use: in a run folder it is our appending one
_LIGHTNING_CSV = ("lightning.pytorch.loggers.CSVLogger", "lightning.pytorch.loggers.csv_logs.CSVLogger")


FIT_DESCRIPTION = (
    "Train a LightningModule: one of lit_trainer's, {modules}, or your own (the run folder is runs/<its RUN_NAME>, "
    "else runs/<its class name in lower case>, unless --run_name names it). The options listed here are "
    "the trainer's and the run's. To list the model's and the data module's options: "
    "`lit-trainer fit --model.help lit_trainer.CausalLMModule` (or any module above) and "
    "`lit-trainer fit --data.help lit_trainer.data.SFTDataModule` (or PreferenceDataModule, "
    "UnpairedPreferenceDataModule, PromptDataModule). They print the short spelling `--model.learning_rate`; the docs "
    "and configs write `--model.init_args.learning_rate`: both set the same option. Recipes and commands: "
    "`lit-trainer --help`."
)


def fit_description() -> str:
    """``lit-trainer fit --help``'s description: every module of ``lit_trainer.__all__`` with the run folder its
    ``RUN_NAME`` gives (read from the classes, so a new module appears here without editing this text)."""
    import lit_trainer

    modules = ", ".join(f"{name} (runs/{getattr(lit_trainer, name).RUN_NAME})" for name in lit_trainer.__all__)
    return FIT_DESCRIPTION.format(modules=modules)


CKPT_PATH_INSTEAD = "--ckpt_path last (the newest complete checkpoint of this run; incomplete ones are skipped)"
CKPT_PATH_HELP = (
    "Continue a run instead of starting a new one. 'last': the newest complete checkpoint of an unfinished run with "
    "this run name and the same model and data arguments (data-loading and eval_* options, and every trainer "
    "option, may change); when none qualifies, a new run starts and a warning lists the checkpoints passed over. "
    "PATH: that checkpoint, on purpose (changed model or data arguments are reported; another module, data module "
    "or run name is refused). Unset: a new run. (type: str | None, default: null)"
)


def default_loggers() -> list[dict[str, Any]]:
    """CSV always; TensorBoard too when ``tensorboard`` is importable. Folder, name and version are filled in per
    run (``LitTrainerCLI.before_instantiate_classes``)."""
    import importlib.util

    common = {"save_dir": DEFAULT_ROOT, "name": None, "version": None}
    loggers = [{"class_path": "lit_trainer.cli.runs.RunCSVLogger", "init_args": dict(common)}]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(
            {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {**common, "default_hp_metric": False},
            }
        )
    return loggers


def unbounded_run_error(max_steps: int | None, max_epochs: int | None, max_time: Any) -> str | None:
    """Why a ``fit`` with these limits would not stop by itself, or ``None`` when it is bounded.

    Example:
        >>> unbounded_run_error(1500, None, None) is None
        True
        >>> "forever" in unbounded_run_error(-1, -1, None)
        True
    """
    if max_time is not None or max_steps not in (None, -1) or max_epochs not in (None, -1):
        return None
    epochs = (
        "`trainer.max_epochs=-1` (no epoch limit) means the run would train forever"
        if max_epochs == -1
        else "`trainer.max_epochs` unset means Lightning would stop after an arbitrary 1000 epochs"
    )
    return (
        f"`trainer.max_steps=-1` (no step limit) with {epochs}. Set --trainer.max_steps (e.g. 1500) or "
        "--trainer.max_epochs to a positive number (or --trainer.max_time)."
    )


def _import(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _as_list(value: Any) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]


def _init_arg(entry: Any, key: str) -> Any:
    init_args = entry.get("init_args") if hasattr(entry, "get") else None
    return init_args.get(key) if init_args is not None and hasattr(init_args, "get") else None


class LitTrainerCLI(LightningCLI):
    """The ``lit-trainer`` command (``fit``, ``validate``, ``test``, ``predict`` subcommands, ``--config``,
    ``--print_config``, ``--run_name``, ``--report_to``)."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        parser_kwargs = kwargs.pop("parser_kwargs", None) or {}
        parser_kwargs.setdefault("fit", {}).setdefault("description", fit_description())
        trainer_defaults = {"logger": default_loggers(), "num_sanity_val_steps": 0}
        trainer_defaults.update(kwargs.pop("trainer_defaults", {}))
        self._resume_from: str | None = None
        self._identity_config: dict[str, Any] | None = None
        self._fresh_run_dir: Path | None = None
        self._resumed_run: RunFolderState | None = None  # the run folder as it was before this resumed part
        self._resume_step = 0  # the global step of the checkpoint resumed from
        # the command line, for the one instruction a JITCheckpoint stop prints (none for a dict of arguments)
        self._argv = sys.argv[1:] if args is None else [str(a) for a in args] if isinstance(args, list) else None
        quiet_startup_noise()
        quiet_progress_bars_off_terminal()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
            super().__init__(
                model_class=BaseModule,
                datamodule_class=BaseDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                seed_everything_default=DEFAULT_SEED,
                parser_class=FriendlyParser,
                save_config_kwargs={"overwrite": True},  # a resumed run rewrites its own config.yaml
                auto_configure_optimizers=False,
                trainer_defaults=trainer_defaults,
                parser_kwargs=parser_kwargs,
                args=join_negative_numbers(args) if isinstance(args, list) else args,
                run=run,
                **kwargs,
            )

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Link the model's name/path to the data module's tokenizer; add ``--run_name`` and ``--report_to``."""
        parser.link_arguments("model.init_args.model", "data.init_args.tokenizer", apply_on="parse")
        parser.add_argument(
            "--run_name",
            type=str | None,
            default=None,
            help="Folder name of the run under trainer.default_root_dir (default: sft, dpo, grpo, "
            "reward from the model class; the class name in lower case for other modules).",
        )
        parser.add_argument("--report_to", type=str | None, default=None, help=REPORT_TO_HELP)

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        """Lightning's subcommand parser; ``fit --ckpt_path`` explains what ``last`` and a path mean here."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "fit":
            for action in parser._actions:
                if "--ckpt_path" in action.option_strings:
                    action.help = CKPT_PATH_HELP
        return parser

    def _parse_ckpt_path(self) -> None:
        """``fit``: keep the configuration given (file and command line) on a resume.

        Lightning's CLI would replace the model's class and arguments with the checkpoint's hyper-parameters when
        ``--ckpt_path`` is a file (not for ``last``): an SFT config resumed from a GRPO checkpoint silently became a
        GRPO run, and options changed on the command line for the resume were dropped. For ``fit`` the config
        decides, and a checkpoint of another run is refused (``before_instantiate_classes``); ``validate``,
        ``test`` and ``predict`` keep Lightning's behaviour (evaluate a checkpoint with its own hyper-parameters).
        """
        if self.config.get("subcommand") != "fit":
            super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        """Place the run: root, run name, version folder; find and check the checkpoint to resume."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config["trainer"]
        if self.subcommand == "fit":
            error = unbounded_run_error(trainer.get("max_steps"), trainer.get("max_epochs"), trainer.get("max_time"))
            if error:
                raise ValueError(error)
        root = trainer.get("default_root_dir") or DEFAULT_ROOT
        name = config.get("run_name") or default_run_name(config["model"]["class_path"])
        trainer["default_root_dir"], config["run_name"] = str(root), name
        if config.get("report_to") is not None:
            trainer["logger"] = tracker_loggers(
                parse_report_to(config["report_to"]), _as_list(trainer.get("logger")), str(root)
            )
        loggers = [lg for lg in _as_list(trainer.get("logger")) if str(lg.get("class_path", "")).endswith(_RUN_LOGGERS)]
        for logger in loggers:
            if logger.get("class_path") in _LIGHTNING_CSV:
                logger["class_path"] = "lit_trainer.cli.runs.RunCSVLogger"
        self._identity_config = flatten_config({"model": config.get("model"), "data": config.get("data")})
        run_root = Path(root) / name
        version = None
        if self.subcommand == "fit" and config.get("ckpt_path") is not None:
            self._resume_from, version = self._resume_target(config, run_root)
        if version is None:
            pinned = _init_arg(loggers[0], "version") if loggers else None
            version, note = self._fresh_version(run_root, pinned, reserve=bool(loggers))
            if note:
                rank_zero_info(f"[lit_trainer] {note}")
            if self.subcommand == "fit":
                self._fresh_run_dir = run_root / version_folder(version)
        elif self.subcommand == "fit" and rank_zero_only.rank == 0:
            self._resumed_run = RunFolderState(run_root / version_folder(version))
            kept = keep_part_records(run_root / version_folder(version))
            if kept is not None:
                rank_zero_info(f"[lit_trainer] the records of the run's earlier part are kept in {kept}")
        for logger in loggers:
            for key, value in (("save_dir", str(root)), ("name", name), ("version", version)):
                logger["init_args"][key] = value
        place_remote_trackers(_as_list(trainer.get("logger")), str(root), name, version_folder(version))

    def _fresh_version(self, run_root: Path, pinned: int | str | None, reserve: bool) -> tuple[int | str, str | None]:
        """Rank 0 reserves a new version folder (created at once, so simultaneous runs, ``fit``, ``validate``, ...,
        never share one); the other ranks of the run take that folder. Without a run logger nothing is written in
        a run folder, so none is made."""
        if not reserve:
            return fresh_version(run_root, pinned)
        if rank_zero_only.rank == 0:
            version, note = reserve_version(run_root, pinned)
            os.environ[RUN_DIR_ENV] = str((run_root / version_folder(version)).resolve())
            return version, note
        reserved = Path(os.environ.get(RUN_DIR_ENV, ""))
        if reserved.name and reserved.parent == run_root.resolve():  # Lightning's launcher started this rank
            number = version_number(reserved.name)
            return (number if number is not None else reserved.name), None
        return fresh_version(run_root, pinned)  # launched on its own (torchrun): Lightning broadcasts rank 0's folder

    def instantiate_classes(self) -> None:
        """Build the classes; a validation error of ours comes out alone, not inside jsonargparse's Union text."""
        try:
            super().instantiate_classes()
        except BaseException as error:
            self._remove_fresh_run_dir()
            self._restore_resumed_run()
            friendly = friendly_value_error(error) if isinstance(error, ValueError) else None
            if friendly is None:
                raise
            raise friendly from None

    def _remove_fresh_run_dir(self) -> None:
        """Remove the folder a fresh run reserved, on rank 0, when it fails before its first optimizer step."""
        fresh = self._fresh_run_dir
        if fresh is not None and rank_zero_only.rank == 0 and remove_unused_run_folder(fresh):
            rank_zero_info(f"[lit_trainer] removed {self._fresh_run_dir}: the run failed before it trained")

    def _restore_resumed_run(self) -> None:
        """Put the run folder back as it was, on rank 0, when a resumed part fails before its first optimizer step
        (a refused resume): it trained nothing, so its records must not replace those of the run that trained."""
        state, self._resumed_run = self._resumed_run, None
        if state is not None and rank_zero_only.rank == 0 and state.restore():
            rank_zero_info(f"[lit_trainer] {state.run_dir} is left as it was: the resumed part stopped before training")

    def _current_run(self, config: Any, run_root: Path) -> dict[str, Any]:
        """This run's identity, as :func:`~lit_trainer.callbacks.run_identity.pick_last` compares it with
        checkpoints."""
        data, module = config.get("data"), _import(config["model"]["class_path"])
        return {
            "module": class_path(module),
            "datamodule": class_path(_import(data["class_path"])) if data else None,
            "run_name": run_root.name,
            "config": self._identity_config,
            "retired": retired_options(module),
        }

    @staticmethod
    def _checkpoint_dirs(config: Any, run_root: Path) -> list[str]:
        """The folders ``--ckpt_path last`` searches: the callbacks' ``dirpath`` and every run's ``checkpoints``."""
        dirs = [str(d) for cb in _as_list(config["trainer"].get("callbacks")) if (d := _init_arg(cb, "dirpath"))]
        return dirs + sorted(str(p) for p in run_root.glob("*/checkpoints"))

    def _resume_target(self, config: Any, run_root: Path) -> tuple[str | None, int | str | None]:
        """The checkpoint to resume (``None``: fresh start) and the version folder the run continues in."""
        requested = str(config["ckpt_path"])
        current = self._current_run(config, run_root)
        if requested in ("last", "auto"):
            path, skipped = pick_last(complete_checkpoints(self._checkpoint_dirs(config, run_root)), current)
            if path is None and skipped:
                rank_zero_warn(_nothing_to_continue(requested, run_root, skipped))
            elif path is None:
                rank_zero_info(
                    f"[lit_trainer] --ckpt_path {requested}: no complete checkpoint of run "
                    f"'{run_root.name}' in {run_root}, starting fresh"
                )
            if path is None:
                return None, None
        else:
            path = checked_checkpoint(requested, given=f"--ckpt_path {requested}", instead=CKPT_PATH_INSTEAD)
        record = read_record(path) or {}
        self._resume_step = int(record.get("global_step") or 0)
        message = identity_mismatch(record, current, path) if record else None
        if message:
            raise ValueError(message)
        max_steps = config["trainer"].get("max_steps")
        if record.get("finished") and max_steps not in (None, -1) and record.get("global_step", 0) >= max_steps:
            rank_zero_warn(
                f"{path} is the end of a finished run (step {record.get('global_step')}) and this run stops at "
                f"max_steps={max_steps}: nothing will be trained. Raise --trainer.max_steps to continue it."
            )
        version = version_of(path, run_root, record.get("run_dir"))
        rank_zero_info(
            f"[lit_trainer] resuming from {path}"
            + (f"; the run continues in {run_root / version_folder(version)}" if version is not None else "")
        )
        return path, version

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Any:
        """Add the run record, the final metrics table, the CPU thread check and our progress bar."""
        given = _as_list(config.get("callbacks")) + callbacks
        run_name = (self.config[self.subcommand] if self.subcommand else self.config).get("run_name")
        identity = RunIdentity(run_name=run_name, config=self._identity_config)
        extra: list[Callback] = [identity, FinalMetrics(), CPUThreadCheck(), CurvesPlot()]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            extra.append(default_progress_bar())
        present = {type(c) for c in given}
        callbacks = callbacks + [c for c in extra if type(c) not in present]
        return super()._instantiate_trainer(config, callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; a fresh ``fit`` that fails before its first optimizer step leaves no run folder behind, a resumed
        one leaves its run folder as it was; a full disk says which checkpoint ``--ckpt_path`` continues from."""
        try:
            super()._run_subcommand(subcommand)
        except BaseException as error:
            trainer = getattr(self, "trainer", None)
            if trainer is None or trainer.global_step == 0:
                self._remove_fresh_run_dir()
            if trainer is None or trainer.global_step <= self._resume_step:
                self._restore_resumed_run()
            if isinstance(error, NoSpaceError) and subcommand == "fit":
                error.continue_from = self._continue_from()
            raise

    def _continue_from(self) -> tuple[str, str] | None:
        """After a failed write: ``(the --ckpt_path value that continues this run, what it does)``, or ``None`` when
        the run has no complete checkpoint to continue from."""
        config = self.config[self.subcommand]
        run_root = Path(config["trainer"]["default_root_dir"]) / config["run_name"]
        run_dir = Path(self.trainer.log_dir) if self.trainer.log_dir else None
        found = complete_checkpoints(self._checkpoint_dirs(config, run_root))
        path, _ = pick_last(found, self._current_run(config, run_root))
        if path is not None:
            step = (read_record(path) or {}).get("global_step")
            return "last", f"resumes from {path}" + (f" at step {step}" if step is not None else "")
        own = [p for p in found if run_dir is not None and run_dir.resolve() in Path(p).resolve().parents]
        if own:  # the run's newest checkpoint is its end (the failed write came after it): finish from it
            return own[0], "trains nothing more and writes what is missing (the HF export)"
        return None

    def before_fit(self) -> None:
        """Hand the resolved checkpoint to ``fit``; a fresh start that Lightning would turn into a resume raises.
        Every checkpoint of the run is written atomically (a partial name, renamed once complete)."""
        config = self.config_init[self.config_init.subcommand]
        self.trainer.strategy.checkpoint_io = with_atomic_writes(self.trainer.strategy.checkpoint_io)
        quiet_frozen_eval_mode_warning(self.model)
        if (note := hub_kernel_note(bool(getattr(self.model, "is_quantized", False)))) is not None:
            rank_zero_info(note)
        if self._argv:  # a JITCheckpoint stop says how to continue with this command, not with `trainer.fit`
            for callback in self.trainer.callbacks:
                if hasattr(callback, "resume_instruction"):
                    callback.resume_instruction = resume_hint(self._argv)
        rank_zero_info(f"[lit_trainer] run folder: {self.trainer.log_dir}")
        if self._resume_from is None:
            resolve_resume("never", [], self.trainer)
        else:  # continuing in the run's own folder is the point; Lightning would warn that it is not empty
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            rewind_trackers(self.trainer.loggers, self._resume_from)
        config["ckpt_path"] = self._resume_from


def rewind_trackers(loggers: list[Any], checkpoint: str) -> None:
    """Before a resume from ``checkpoint``: loggers that can (``rewind(step)``: ``RunCSVLogger``, ``TrackioLogger``)
    drop what the interrupted run logged after that checkpoint, since the resumed run logs those steps again; a
    TensorBoard logger whose writer is not open yet opens it with ``purge_step``, which hides the events logged at
    that step and after (TensorBoard's own mechanism for a resumed run)."""
    step = (read_record(checkpoint) or {}).get("global_step")
    if step is None:
        return
    for logger in loggers:
        rewind = getattr(logger, "rewind", None)
        if callable(rewind):
            rewind(int(step))
        elif type(logger).__name__ == "TensorBoardLogger" and getattr(logger, "_experiment", True) is None:
            logger._kwargs.setdefault("purge_step", int(step))  # passed to SummaryWriter when it opens


def _nothing_to_continue(requested: str, run_root: Path, skipped: list[tuple[str, str]]) -> str:
    lines = [f"  - {path}: {reason}" for path, reason in skipped]
    return (
        f"--ckpt_path {requested}: no checkpoint of run '{run_root.name}' can be continued with this configuration, "
        "so this is a new run. Passed over:\n" + "\n".join(lines) + "\nTo continue one of them on purpose, pass "
        "its path: --ckpt_path PATH (for a finished run, also raise --trainer.max_steps or --trainer.max_epochs)."
    )


def resume_hint(argv: list[str], ckpt_path: str = "last") -> str:
    """The command that continues a run stopped by ``JITCheckpoint``: the same arguments with ``--ckpt_path last``
    (which picks the run's newest complete checkpoint: the one the stop wrote), or ``ckpt_path``. The CLI hands it to
    the callback, which prints it once, after the save.

    Example:
        >>> resume_hint(["fit", "--config", "configs/sft.yaml"])
        'To continue this run: lit-trainer fit --config configs/sft.yaml --ckpt_path last'
    """
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return "To continue this run: " + shlex.join(["lit-trainer", *kept, "--ckpt_path", ckpt_path])


def no_space_message(error: NoSpaceError, argv: list[str]) -> str:
    """The one line ``lit-trainer`` prints when a checkpoint or export did not fit on the disk: what failed, and how
    to continue once space is freed (``error.continue_from``, set by ``LitTrainerCLI``).

    Example:
        >>> from pathlib import Path
        >>> error = NoSpaceError("Could not write the checkpoint c/last.ckpt: no space left on device in c.", Path(), 0)
        >>> error.continue_from = ("last", "resumes from c/step=2.ckpt at step 2")
        >>> no_space_message(error, ["fit", "--config", "configs/sft.yaml"])  # doctest: +NORMALIZE_WHITESPACE
        'Could not write the checkpoint c/last.ckpt: no space left on device in c. Free space, then continue:
        lit-trainer fit --config configs/sft.yaml --ckpt_path last (resumes from c/step=2.ckpt at step 2).'
    """
    text = str(error)
    target = getattr(error, "continue_from", None)
    if target is None:
        return f"{text} No complete checkpoint of this run is left to continue from: free space and start it again."
    ckpt_path, what = target
    command = resume_hint(argv, ckpt_path).removeprefix("To continue this run: ") if argv else None
    if command is None:
        return f"{text} Free space, then continue with --ckpt_path {ckpt_path} ({what})."
    return f"{text} Free space, then continue: {command} ({what})."


def main(args: Any = None) -> None:
    """Entry point of the ``lit-trainer`` console script.

    An error raised by one of lit_trainer's own input checks during the run (an empty data file, a checkpoint of
    another run, ...) is printed as one message without the traceback, exit status 1; ``LIT_TRAINER_TRACEBACK=1``
    shows the traceback. So is a checkpoint or export that did not fit on the disk (:func:`no_space_message`: the
    folder, the space needed and free, and the command that continues the run). Other errors propagate unchanged.
    """
    try:
        if args is None:
            sys.argv[1:] = join_negative_numbers(sys.argv[1:])
            LitTrainerCLI()
        else:
            LitTrainerCLI(args=args)
    except NoSpaceError as full:
        if os.environ.get(TRACEBACK_ENV):
            raise
        argv = sys.argv[1:] if args is None else [str(a) for a in args] if isinstance(args, list) else []
        exit_with_message(no_space_message(full, argv))
    except Exception as error:
        if os.environ.get(TRACEBACK_ENV) or not raised_by_our_checks(error):
            raise
        exit_with_message(error)


if __name__ == "__main__":
    main()
