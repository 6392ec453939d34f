"""Just-in-time checkpoint on SIGTERM (preemption), safe across DDP ranks.

Reference: ``transformers`` ``enable_jit_checkpoint`` (docs/design.md#hf-jit-checkpoint); Lightning's own SIGTERM
handling (docs/design.md#lightning-sigterm). What is the same as the reference: only the handler's signal is
recorded, a save starts ``kill_wait`` seconds after the signal at the earliest, the sentinel
``checkpoint-is-incomplete.txt`` is written before the save and removed after it. What differs, on purpose:

* **Step boundary.** The request is acted on only right after an optimizer step (``on_train_batch_end`` when
  ``trainer.global_step`` changed), never inside an accumulation window, and the checkpoint holds exactly the
  updates that were applied (the reference saves step N, then applies step N+1 anyway).
* **Inside a long step.** The handler prints one line at once. A module whose step can run for minutes (GRPO's
  generation round) polls :attr:`stop_requested` and, on every rank before it applies anything of the step, calls
  :meth:`stop_in_step`: if a signal is due on any rank the step's partial work is dropped, the last finished optimizer
  step is saved and every rank stops (the duck-typed contract is in ``lit_trainer/_stop_request.py``). A signal that
  reaches one rank only is posted in the process group's store, which the other ranks' generations poll, so they
  stop too instead of generating the whole round while the signalled rank waits in the all-reduce
  (``_stop_board.py``).
* **Logs.** Before the save, the step's logs are written (the module's ``on_train_batch_end``, Lightning's step
  metrics, a module's ``write_pending_logs``), so the saved step has its one row in every logger.
* **Every rank agrees.** At each optimizer step all ranks reduce their flags (any-rank semantics: one tiny
  all-reduce per optimizer step, nothing inside the signal handler). A signal that reaches one rank, some ranks or
  every rank stops all of them at the same step. Lightning's handler (a broadcast inside the handler, only rank 0's
  flag counts) deadlocks in two of these cases, and so does the reference; this callback replaces it for the
  handled signals while training runs (from ``on_sanity_check_start``/``on_train_start``, since Lightning
  re-registers its handler at the start of every ``fit``) and puts the previous handlers back at the end.
* **Validation.** A signal that arrives during a validation run inside ``fit`` is acted on when that validation
  ends (``on_validation_end``, all ranks agree there too) if the last training batch closed an optimizer step;
  otherwise (validation scheduled mid-window) at the next optimizer step. The validation in progress finishes,
  and every other callback's ``on_validation_end`` (which swaps EMA/BEMA weights back) has run before the save.
* **Ordering.** At setup the callback moves itself behind every other non-``Checkpoint`` callback, so its save
  sees their end-of-step state (an EMA/BEMA update made in their ``on_train_batch_end``).
* **Atomic.** The file is written under a hidden partial name and renamed into place (``_atomic.commit``), so a
  reader never sees half a checkpoint; ``lit_trainer.callbacks.resolve_resume_checkpoint`` skips the one a
  left-over sentinel names. An ``AsyncCheckpointIO`` is flushed before the rename.
* **Failures.** Code that meets a failure where the training state is whole (a training row that cannot be
  loaded, a GRPO rollout worker that died) calls :meth:`stop_for_failure`: the last finished optimizer step is saved
  as for a signal, then :class:`JITCheckpointFailure` stops the run with the cause in one line (exit status 1). One
  process only: under DDP the other ranks are already inside the step, so the failing rank raises its error without
  a save.
* **Exit status.** After the save every rank raises :class:`JITCheckpointExit`, a ``SystemExit`` with
  ``exit_code``. The default ``"signal"`` is what a shell reports for a process killed by that signal, 128 + its
  number: 143 for SIGTERM (so Slurm, Kubernetes ``OnFailure`` and torchrun treat the job as failed/preempted and
  can requeue it), 130 for SIGINT (Ctrl-C). Lightning's ``SIGTERMException`` exits with status 0, which schedulers
  read as "finished". An int sets one status for every signal; ``exit_code=None`` sets ``trainer.should_stop``
  instead and ``fit`` returns normally.
* **Ctrl-C.** With ``"SIGINT"`` in ``signals`` (the shipped recipes), the first Ctrl-C saves at the next
  optimizer step exactly as SIGTERM does, without waiting for ``kill_wait`` (nobody sends SIGKILL after a Ctrl-C),
  and exits with 130; a second Ctrl-C before the save raises ``KeyboardInterrupt`` at once (Lightning's interrupt
  handling then stops the run without a checkpoint, exit status 1).

Sizing the grace period: a save starts at the first optimizer-step boundary at least ``kill_wait`` seconds after
the signal, so the worst case from signal to exit is ``kill_wait + one optimizer step (all micro-batches of the
window, plus a validation run if one is in progress) + the save time + process teardown``; a generation that polls
:attr:`stop_requested` shortens the step to one forward pass (docs/checkpoints.md has the table). Set the scheduler's
grace period (Kubernetes ``terminationGracePeriodSeconds``, Slurm ``--signal=TERM@<seconds>``) above that.
``kill_wait`` exists to tell "SIGTERM then SIGKILL right away" (no grace period: do not start a save that cannot
finish) from a real grace period; ``kill_wait=0`` saves at the next boundary.

Launchers: every rank exits with ``exit_code`` after the rename (all ranks wait for it, so a launcher that kills
the others when one rank exits, such as torchrun, cannot cut the save short). Under Lightning's own subprocess
launcher (``strategy="ddp"`` started as a script) rank 0's watchdog may SIGKILL rank 0 if rank 1 exits first, so
rank 0 can report 137 instead of 143; the checkpoint is complete either way. Under Slurm, ``--signal=TERM@<s>``
fits the default; to use Slurm's ``SIGUSR1`` instead pass ``signals=["SIGUSR1", "SIGTERM"]`` (this replaces
Lightning's SIGUSR1 handler, which saves from inside the handler, while training runs).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_trainer.callbacks._stop_board import StopBoard
from lit_trainer.callbacks._stop_logs import (
    logger_step_for_a_save_inside_a_batch,
    write_pending_logs,
    write_step_logs,
)
from lit_trainer.checkpoint_io import SENTINEL_NAME, sentinel_target, write_sentinel
from lit_trainer.core.atomic import commit, is_local_path, partial_path
from lit_trainer.core.lightning_namespace import PackageBound

_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


class JITCheckpointExit(SystemExit):
    """Raised on every rank after a just-in-time checkpoint was saved; ``code`` is ``JITCheckpoint.exit_code``.

    Lightning runs every callback's ``on_exception`` and its teardown, then ``fit`` re-raises it; uncaught, the
    process exits with ``code``. ``checkpoint_path`` is the saved checkpoint.
    """

    def __init__(self, code: int | str, checkpoint_path: str) -> None:
        super().__init__(code)
        self.checkpoint_path = checkpoint_path


class JITCheckpointFailure(JITCheckpointExit):
    """Raised after a just-in-time checkpoint was saved because training failed where its state was whole: a
    training row that cannot be loaded (``lit_trainer.data.bad_rows``), a GRPO rollout worker that died.

    ``code`` is ``reason``, the one-line cause: uncaught, Python prints it on stderr and the process exits with
    status 1 (no traceback). ``checkpoint_path`` holds the last finished optimizer step.
    """

    def __init__(self, reason: str, checkpoint_path: str) -> None:
        super().__init__(reason, checkpoint_path)
        self.reason = reason


def _signal_numbers(signals: Sequence[str]) -> list[signal.Signals]:
    if isinstance(signals, str) or not signals:
        raise ValueError(f"`JITCheckpoint(signals={signals!r})` is invalid: pass a non-empty list such as ['SIGTERM'].")
    valid = {s.name for s in signal.Signals} - _UNCATCHABLE
    bad = [s for s in signals if s not in valid]
    if bad:
        raise ValueError(
            f"`JITCheckpoint(signals={list(signals)!r})` is invalid: {bad} cannot be handled on this platform. "
            f"Use names such as 'SIGTERM', 'SIGUSR1' or 'SIGINT' (SIGKILL and SIGSTOP cannot be caught)."
        )
    return [signal.Signals[s] for s in dict.fromkeys(signals)]


class _JITCheckpoint(PackageBound):
    """Save the full training state at the next optimizer step after a signal, on every rank, then stop.

    See the module docstring for the protocol, the exit status and how to size the grace period.

    Args:
        kill_wait: seconds between the signal and the earliest save (the reference's ``kill_wait``, fixed at 3 there).
        signals: names of the signals that request a checkpoint (``SIGKILL``/``SIGSTOP`` cannot be caught).
        dirpath: folder of the checkpoints; ``None`` is the folder of the trainer's ``ModelCheckpoint`` when it was
            given one, else the run's own ``checkpoints`` folder, where a default ``ModelCheckpoint`` writes:
            ``<save_dir>/<name>/<version>/checkpoints`` of the first logger, or ``<trainer.default_root_dir>/
            checkpoints`` without a logger. Local paths only (the rename must be atomic).
        filename: name of the checkpoint without ``.ckpt``; ``{epoch}`` and ``{step}`` are filled in. The default
            starts with ``last``: Lightning's own ``trainer.fit(..., ckpt_path="last")`` loads the newest ``last*``
            file of the ``ModelCheckpoint`` folders, so a relaunch with ``ckpt_path="last"`` continues from it (as
            ``lit-trainer``'s ``--ckpt_path last`` does, which reads every checkpoint of the run's folder).
        exit_code: status of :class:`JITCheckpointExit` raised after the save: ``"signal"`` (128 + the signal's
            number: 143 for SIGTERM, 130 for SIGINT), or an int 0-255 for every signal; ``None`` sets
            ``trainer.should_stop`` instead, so ``fit`` returns (Lightning then runs one validation and the
            epoch-end hooks, as for ``EarlyStopping``, and ``min_steps``/``min_epochs`` can veto the stop).

    Raises:
        ValueError: for a negative or non-finite ``kill_wait``, unknown or uncatchable ``signals``, a remote
            ``dirpath``, an ``exit_code`` outside 0-255, or a ``filename`` with other placeholders.

    Example::

        trainer = Trainer(callbacks=[ExactResume(), JITCheckpoint(kill_wait=3.0)], use_distributed_sampler=False)
        trainer.fit(module, datamodule, ckpt_path=resolve_resume("auto", "runs/x/checkpoints"))
        # on SIGTERM: runs/x/checkpoints/last-jit-epoch=E-step=S.ckpt, then the process exits with status 143;
        # in a plain Lightning project, the relaunch `trainer.fit(module, ckpt_path="last")` continues from it
    """

    def __init__(
        self,
        kill_wait: float = 3.0,
        signals: Sequence[str] = ("SIGTERM",),
        dirpath: str | os.PathLike | None = None,
        filename: str = "last-jit-epoch={epoch}-step={step}",
        exit_code: int | Literal["signal"] | None = "signal",
    ) -> None:
        super().__init__()
        if not (isinstance(kill_wait, (int, float)) and math.isfinite(kill_wait) and kill_wait >= 0):
            raise ValueError(f"`JITCheckpoint(kill_wait={kill_wait!r})` is invalid: kill_wait must be a number >= 0.")
        valid_code = exit_code in (None, "signal") or (
            isinstance(exit_code, int) and not isinstance(exit_code, bool) and 0 <= exit_code <= 255
        )
        if not valid_code:
            raise ValueError(
                f"`JITCheckpoint(exit_code={exit_code!r})` is invalid: use 'signal' (128 + the signal number), "
                "an int in 0-255 or None."
            )
        if dirpath is not None and not is_local_path(dirpath):
            raise ValueError(f"`JITCheckpoint(dirpath={str(dirpath)!r})` is invalid: use a local (or mounted) folder.")
        try:
            filename.format(epoch=0, step=0)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"`JITCheckpoint(filename={filename!r})` is invalid: only the placeholders {{epoch}} and {{step}} "
                "are filled in."
            ) from err
        self.kill_wait = float(kill_wait)
        self.signals = _signal_numbers(signals)
        self._dirpath_arg = None if dirpath is None else str(dirpath)
        self.dirpath = self._dirpath_arg
        self.filename = filename
        self.exit_code = exit_code
        self.checkpoint_path: str | None = None
        self.save_seconds: float | None = None
        self._requested_at: float | None = None
        self._signal: int | None = None
        self._rank = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._last_step: int | None = None
        self._at_boundary = False
        self._done = False
        self._board = StopBoard()  # one process until setup opens the run's
        self._searched: set[Path] = set()  # the folders Lightning's ckpt_path="last" searches (set in setup)
        self._versioned = False  # the checkpoints go to a logger's version folder (set in setup)
        #: how to continue, said once after the save; None: the ``fit(..., ckpt_path=...)`` call that does (a launcher
        #: sets its own command instead: ``lit-trainer`` sets the command line with ``--ckpt_path last``)
        self.resume_instruction: str | None = None

    @property
    def requested(self) -> bool:
        """Whether a handled signal arrived (the save may still wait for ``kill_wait`` and the next step)."""
        return self._requested_at is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # record, and say so with one unbuffered write (no logging, no collective: they can deadlock in a handler)
        if self._requested_at is None:
            self._requested_at, self._signal = time.monotonic(), signum
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), self._acknowledgement(signum).encode())
        elif signum == signal.SIGINT:  # a second Ctrl-C: the person wants out now, without a checkpoint
            raise KeyboardInterrupt

    def _due(self) -> bool:
        if self._requested_at is None:
            return False
        # kill_wait guards against a SIGKILL right after the signal; nobody sends one after a Ctrl-C
        return self._signal == signal.SIGINT or time.monotonic() - self._requested_at >= self.kill_wait

    def _acknowledgement(self, signum: int) -> str:
        """The line printed, on the rank that got it, the moment a handled signal arrives."""
        waits = signum != signal.SIGINT and self.kill_wait > 0
        wait = f" (at least {self.kill_wait:g} s after it)" if waits else ""
        again = " Press Ctrl-C again to stop at once without a checkpoint." if signum == signal.SIGINT else ""
        return (
            f"\nJITCheckpoint: {signal.Signals(signum).name} received on rank {self._rank}: saving a checkpoint at "
            f"the next optimizer step{wait}, then stopping; a generation in progress stops now and its round is "
            f"generated again on resume.{again}\n"
        )

    @property
    def stop_requested(self) -> bool:
        """Whether the work in progress inside a training step (a generation round) should stop now: a signal is due
        on this rank (``kill_wait`` passed; the other ranks are then told through the process group's store), or
        another rank said so there (``_stop_board.py``). Cheap (read on every generated token; the store is polled at
        most every 0.1 s); with ``exit_code=None`` always False, since ``fit`` would then go on training that step."""
        if self.exit_code is None or self._done:
            return False
        if self._due():
            self._board.post()
            return True
        return self._board.seen()

    def stop_in_step(self, trainer: pl.Trainer) -> None:
        """Called by a module on every rank inside a training step that has changed nothing yet (its first
        micro-batch, before any backward): if a signal is due on any rank (all ranks agree, one all-reduce), save the
        state of the last finished optimizer step and raise :class:`JITCheckpointExit`; otherwise return.

        The step's partial work (a generation round cut short) is dropped: Lightning resumes a checkpoint written
        inside a batch at its last completed batch, so the resumed run redoes this one from its start (the saved
        logger step and loader positions leave this batch out to match: :func:`_saving_inside_a_batch`).
        """
        if self.exit_code is None or self._done or not trainer.training:
            return
        if self._due():  # a signal that came after this rank's last token: the others may still be generating
            self._board.post()
        if not trainer.strategy.reduce_boolean_decision(self._due(), all=False):
            return
        self._done = True
        write_pending_logs(trainer.lightning_module)
        with _saving_inside_a_batch(trainer):
            path = self._save_and_say(trainer)
        raise JITCheckpointExit(self._exit_status(trainer), path)

    def stop_for_failure(self, trainer: pl.Trainer, reason: str) -> None:
        """Called by the code that met a failure where the training state is whole on this rank: the last optimizer
        step finished and nothing of the next one is applied (a training row that cannot be loaded, met when its
        window's batches are built; a rollout worker found dead at the start of a round). Saves the last finished
        optimizer step as a signal's stop does, then raises :class:`JITCheckpointFailure` with ``reason``.

        Returns without saving, and the caller raises its own error, when there is nothing to save (no optimizer step
        finished in this run), when ``fit`` is not training, when this callback already stopped the run, or with
        several processes: the other ranks are inside the step by then and cannot join a save (all ranks must).
        """
        if self._done or not trainer.training or trainer.world_size > 1 or trainer.global_step == 0:
            return
        self._done = True
        write_pending_logs(trainer.lightning_module)
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        inside_a_batch = progress.ready > progress.completed  # a training step had started (a round's first batch)
        with _saving_inside_a_batch(trainer) if inside_a_batch else contextlib.nullcontext():
            path = self._save_and_say(trainer)
        raise JITCheckpointFailure(reason, path)

    def _install(self) -> None:
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("JITCheckpoint: fit is not running in the main thread, so no signal handler is installed.")
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _uninstall(self) -> None:
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # checks the trainer's Lightning package
        if stage != TrainerFn.FITTING:
            return
        self._requested_at, self._signal, self._rank = None, None, trainer.global_rank
        self._done, self._at_boundary = False, False
        folder, self._searched, run_folder = self._checkpoint_folders(trainer)
        self.dirpath = self._dirpath_arg or folder
        # the run's folder under a logger is <save_dir>/<name>/version_<n>/checkpoints: a relaunch gets a new version
        self._versioned = bool(trainer.loggers) and Path(self.dirpath).absolute() == Path(run_folder).absolute()
        self._board = StopBoard.open(trainer)
        if self.exit_code is None and (trainer.fit_loop.min_steps or trainer.fit_loop.min_epochs):
            rank_zero_warn(
                "JITCheckpoint(exit_code=None) stops through `trainer.should_stop`, which Lightning ignores "
                "until `min_steps`/`min_epochs` are reached; set an exit_code to stop right after the save."
            )
        # behind every other non-Checkpoint callback (rebinding, not mutating: the running hook loop is unaffected)
        others = [cb for cb in trainer.callbacks if cb is not self]
        at = next((i for i, cb in enumerate(others) if isinstance(cb, self._ns.Checkpoint)), len(others))
        trainer.callbacks = others[:at] + [self] + others[at:]

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._at_boundary = trainer.global_step != self._last_step
        if self._at_boundary:
            self._last_step = trainer.global_step
            self._maybe_stop(trainer, lambda: write_step_logs(trainer, pl_module, outputs, batch, batch_idx))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self._at_boundary:
            self._maybe_stop(trainer, lambda: write_pending_logs(pl_module))  # the step's own row is written

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forget()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._forget()

    def _forget(self) -> None:
        """Training is over: restore the handlers and drop a signal that came too late to act on (after the last
        step), so that a later ``trainer.validate`` in the same process (a notebook) does not see a stop request."""
        self._uninstall()
        self._requested_at, self._signal = None, None

    def _maybe_stop(self, trainer: pl.Trainer, write_logs: Callable[[], None]) -> None:
        """At an optimizer-step boundary: if a signal is due on any rank, write the step's logs, save, stop.

        The logs come first, so that the step the checkpoint holds always has its row in every logger (a resume
        rewinds the loggers to the checkpoint's step: the row is written once, by this part of the run).
        """
        if self._done or not trainer.strategy.reduce_boolean_decision(self._due(), all=False):
            return
        self._done = True
        if self.exit_code is not None:  # fit ends here (with None it goes on and Lightning writes the logs itself)
            write_logs()
        path = self._save_and_say(trainer)
        if self.exit_code is None:
            trainer.should_stop = True
            return
        raise JITCheckpointExit(self._exit_status(trainer), path)

    def _checkpoint_folders(self, trainer: pl.Trainer) -> tuple[str, set[Path], str]:
        """``(folder, searched, run folder)``: this callback's folder (the first ``ModelCheckpoint`` given a local
        ``dirpath``, else the run's; see ``dirpath``), the folders Lightning's ``ckpt_path="last"`` searches for
        ``last*`` files (those of the trainer's ``ModelCheckpoint`` callbacks; one without a ``dirpath`` resolves to
        the run's), and the run's folder."""
        run_folder = run_checkpoint_dir(trainer)  # a collective (rank 0 decides): every rank calls it here, once
        models = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, self._ns.ModelCheckpoint)]
        given = [str(cb.dirpath) for cb in models if cb.dirpath is not None and is_local_path(cb.dirpath)]
        searched = {Path(cb.dirpath if cb.dirpath is not None else run_folder).absolute() for cb in models}
        return (given[0] if given else run_folder), searched, run_folder

    def _save_and_say(self, trainer: pl.Trainer) -> str:
        path = self._save(trainer)
        how = self.resume_instruction or self._fit_instruction(path)
        rank_zero_info(f"JITCheckpoint: saved step {trainer.global_step} to {path} in {self.save_seconds:.2f} s. {how}")
        return path

    def _fit_instruction(self, path: str) -> str:
        """The ``trainer.fit`` call that continues from the checkpoint at ``path`` (a plain Lightning project)."""
        if not (Path(path).name.startswith("last") and Path(path).parent.absolute() in self._searched):
            return (
                f'Continue with fit(..., ckpt_path={path!r}) (Lightning\'s ckpt_path="last" searches only the '
                "folders of ModelCheckpoint callbacks for `last*` files)."
            )
        if self._versioned:  # the folder is the logger's version folder: a relaunch logs to a new version
            return (
                f'Continue with fit(..., ckpt_path={path!r}) (ckpt_path="last" finds it only if the relaunch logs '
                "to the same logger version; a new version searches its own folder)."
            )
        return 'fit(..., ckpt_path="last") continues from it.'

    def _exit_status(self, trainer: pl.Trainer) -> int:
        """``exit_code``, or 128 + the signal (the same on every rank: the highest signal number any rank got)."""
        if self.exit_code != "signal":
            return int(self.exit_code)
        mine = torch.tensor(float(self._signal or 0), device=trainer.strategy.root_device)
        signum = int(trainer.strategy.reduce(mine, reduce_op="max").item())
        return 128 + (signum or signal.SIGTERM)

    def _save(self, trainer: pl.Trainer) -> str:
        """Sentinel, save under a partial name on every rank, flush, rename on rank 0, remove the sentinel."""
        assert self.dirpath is not None  # set in setup
        start = time.perf_counter()
        name = self.filename.format(epoch=trainer.current_epoch, step=trainer.global_step) + ".ckpt"
        final = Path(self.dirpath) / name
        tmp = partial_path(final)
        strategy = trainer.strategy
        if trainer.is_global_zero:
            final.parent.mkdir(parents=True, exist_ok=True)
            _remove_leftover(final.parent, tmp)
            write_sentinel(final.parent, name, trainer.global_step)
        strategy.barrier("JITCheckpoint.start")
        trainer.save_checkpoint(tmp, weights_only=False)
        strategy.checkpoint_io.teardown()  # waits for an AsyncCheckpointIO writer (a no-op otherwise)
        strategy.barrier("JITCheckpoint.written")
        if trainer.is_global_zero:
            commit(tmp, final)
            (final.parent / SENTINEL_NAME).unlink(missing_ok=True)
        # every rank waits for the rename: a launcher such as torchrun kills the others when one rank exits
        strategy.barrier("JITCheckpoint.committed")
        self.checkpoint_path = str(final)
        self.save_seconds = time.perf_counter() - start
        return self.checkpoint_path


@contextlib.contextmanager
def _saving_inside_a_batch(trainer: pl.Trainer) -> Iterator[None]:
    """What a checkpoint written inside a training batch (a stop inside a step) saves differently: Lightning resumes
    it at its last completed batch, so the batch in progress is trained again after the resume. The logger step
    (``logger_step_for_a_save_inside_a_batch``) and the training loaders' positions must then not count that batch:
    a loader that counts the batches it handed out (:class:`~lit_trainer.data.loader.TrainLoader`, through its
    ``saving_inside_a_batch``) would otherwise resume one micro-batch after Lightning's batch index. A plain
    ``DataLoader`` under ``ExactResume`` needs nothing: its replay skips Lightning's own resumed batch count."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(logger_step_for_a_save_inside_a_batch(trainer))
        combined = trainer.fit_loop._combined_loader
        for loader in combined.flattened if combined is not None else []:
            leave_out = getattr(loader, "saving_inside_a_batch", None)
            if callable(leave_out):
                stack.enter_context(leave_out())
        yield


def run_checkpoint_dir(trainer: pl.Trainer) -> str:
    """The run's own checkpoint folder, where Lightning's ``ModelCheckpoint`` writes by default.

    ``<save_dir>/<name>/<version>/checkpoints`` of the first logger (``version_<n>`` for an int version), or
    ``<default_root_dir>/checkpoints`` without a logger. Rank 0 decides (a logger's version is chosen there).
    """
    if not trainer.loggers:
        return str(Path(trainer.default_root_dir) / "checkpoints")
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    folder = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / version / "checkpoints"
    return trainer.strategy.broadcast(str(folder))


def _remove_leftover(folder: Path, tmp: Path) -> None:
    """Delete this save's stale partial file and the partial of an earlier interrupted save (named by its sentinel)."""
    stale = [tmp]
    previous = sentinel_target(folder)
    if previous is not None:
        stale.append(partial_path(folder / previous))
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


class JITCheckpoint(_JITCheckpoint, Callback):
    __doc__ = _JITCheckpoint.__doc__
