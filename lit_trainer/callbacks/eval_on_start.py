"""EvalOnStart: one full validation pass before the first optimizer step, logged at step 0.

Reference: ``transformers`` ``eval_on_start`` (docs/design.md#hf-eval-on-start). Lightning's sanity
check runs validation batches before training but throws their metrics away; this callback runs the fit loop's own
validation loop in ``on_train_start`` so the metrics go through the normal loggers at step 0 (the logger step is
the number of optimizer steps taken, 0 here).

What the pass does not do (as in the reference): save a checkpoint or update a best metric. Unlike the reference,
EarlyStopping does not see it either (its patience counter and best score stay untouched), and its metrics are
removed from ``trainer.callback_metrics`` afterwards so no later step-triggered checkpoint or plateau scheduler
acts on the stale step-0 values. The pass runs under ``isolate_rng``, so training with and without this callback
consumes the same random numbers.

Lightning internals used (checked against lightning 2.6; a clear error is raised if they are missing):
``trainer.fit_loop.epoch_loop.val_loop`` (``setup_data``, ``skip``, ``run``, and ``restarting``, cleared so that
right after ``fit(ckpt_path=...)`` the pass is a fresh, complete one rather than a continuation of the restored
progress) and ``trainer._logger_connector`` (``_first_loop_iter``, ``_callback_metrics``), mirroring what the
training epoch loop does around its own validation runs.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.seed import isolate_rng
from typing_extensions import override

from lit_trainer.core.lightning_namespace import PackageBound

_REQUIRED_INTERNALS = (
    ("fit_loop.epoch_loop.val_loop.setup_data", "the fit loop's validation loop"),
    ("fit_loop.epoch_loop.val_loop.run", "the fit loop's validation loop"),
    ("fit_loop.epoch_loop.val_loop.restarting", "the validation loop's restart flag"),
    ("_logger_connector._first_loop_iter", "the logger connector"),
    ("_logger_connector._callback_metrics", "the logger connector"),
)


def _has_path(obj: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def check_lightning_internals(trainer: pl.Trainer) -> None:
    """Fail loudly if the Lightning internals EvalOnStart relies on have moved.

    Args:
        trainer: The trainer in use.

    Raises:
        RuntimeError: Naming the missing attribute and the supported Lightning version.
    """
    for dotted, what in _REQUIRED_INTERNALS:
        if not _has_path(trainer, dotted):
            raise RuntimeError(
                f"EvalOnStart relies on `trainer.{dotted}` ({what}), which this Lightning version does not have. "
                "It is tested with lightning>=2.6,<2.7; pin that version or remove EvalOnStart."
            )


class _EvalOnStart(PackageBound):
    """Run a full validation pass before training starts and log it at step 0.

    Args:
        on_resume: Also run the pass when ``fit`` resumes from a checkpoint (``ckpt_path``); it is then logged at
            the resumed step. By default a resumed run does not evaluate again before continuing.

    Raises:
        RuntimeError: At ``on_train_start`` if the module has no ``validation_step``, ``limit_val_batches`` is 0,
            or the validation dataloader yields no batches.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[EvalOnStart()], num_sanity_val_steps=0)  # doctest: +SKIP
    """

    def __init__(self, on_resume: bool = False) -> None:
        super().__init__()
        self.on_resume = on_resume

    @classmethod
    def _check_validation_data(cls, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = type(pl_module).__name__
        if not cls._ns.is_overridden("validation_step", pl_module):
            raise RuntimeError(f"EvalOnStart needs validation data, but {name} defines no `validation_step`.")
        if trainer.limit_val_batches == 0:
            raise RuntimeError("EvalOnStart needs validation data, but `Trainer(limit_val_batches=0)` disables it.")
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        if trainer.enable_validation:
            val_loop.setup_data()
        if not trainer.enable_validation or val_loop.skip:
            raise RuntimeError(
                f"EvalOnStart needs validation data, but {name} (or its datamodule) gives no validation batches: "
                "define `val_dataloader()` returning a non-empty dataloader, or remove EvalOnStart."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None and not self.on_resume:
            self._ns.rank_zero_info(
                "EvalOnStart: resuming from a checkpoint, skipping the start evaluation (on_resume=False)."
            )
            return
        check_lightning_internals(trainer)
        self._check_validation_data(trainer, pl_module)
        self.run_validation(trainer)

    @classmethod
    def run_validation(cls, trainer: pl.Trainer) -> None:
        """Run the fit loop's validation loop now, without checkpoint or early-stopping side effects.

        Args:
            trainer: A trainer inside ``fit`` (between ``on_train_start`` and the first optimizer step).
        """
        connector = trainer._logger_connector
        first_loop_iter = connector._first_loop_iter
        callback_metrics = dict(connector._callback_metrics)
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        all_callbacks = trainer.callbacks
        quiet = (cls._ns.Checkpoint, cls._ns.EarlyStopping)
        trainer.callbacks = [cb for cb in all_callbacks if not isinstance(cb, quiet)]
        try:
            with isolate_rng():
                trainer.validating = True
                val_loop.restarting = False  # a fresh, complete pass even right after a checkpoint restore
                val_loop.run()
        finally:
            trainer.callbacks = all_callbacks
            trainer.training = True
            connector._first_loop_iter = first_loop_iter
            connector._callback_metrics.clear()
            connector._callback_metrics.update(callback_metrics)


class EvalOnStart(_EvalOnStart, Callback):
    __doc__ = _EvalOnStart.__doc__
