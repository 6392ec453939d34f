"""BestCheckpoint: save only on improvement, keep the N newest, load the best at the end, export it for HF.

Reference: ``transformers`` ``save_strategy="best"`` + ``save_total_limit`` + ``load_best_model_at_end``
(``docs/design.md#hf-best-checkpoint``), built on Lightning's ``ModelCheckpoint``.

Semantics (same as the reference unless noted):

* A checkpoint is written only when the monitored metric strictly improves on the best so far (ties and NaN are
  not improvements). There is no end-of-training save.
* ``mode=None`` infers the direction from the name, as the reference's ``greater_is_better``: ``"min"`` when the
  monitor ends with ``"loss"``, else ``"max"``.
* ``save_total_limit=N`` keeps the N most recently saved checkpoints (save order, not mtime) and never deletes
  the best one. Since only improvements are saved, the newest checkpoint is the best one.
* ``load_best_at_end=True`` loads the best checkpoint's ``state_dict`` into the module in ``on_train_end`` on
  every rank (every rank reads the same file, after a barrier); nothing is loaded (a warning) when no checkpoint
  was saved. Checkpoint callbacks run last, so it wins over weight-averaging callbacks' end-of-training swap.
* ``export_hf=True`` writes the module's ``.model`` (and ``.tokenizer`` when it has ``save_pretrained``) with
  ``save_pretrained`` into ``<dirpath>/best/`` after every new best. The weights come from the checkpoint file
  just written, so the export always equals the best checkpoint (also when a callback such as
  ``EMAWeightAveraging`` puts averaged weights into checkpoints).

Differences from plain ``ModelCheckpoint``:

* Writes are atomic. At setup (``fit``, local ``dirpath``) the callback wraps the strategy's ``checkpoint_io`` in
  ``lit_trainer.checkpoint_io.AtomicCheckpointIO``, so every checkpoint file of the run (this callback's and any
  other ``trainer.save_checkpoint``) is written as ``.<name>.partial`` and renamed when complete: a crash mid-save
  never leaves a file with the final name (that module says what Lightning's own writer guarantees). An
  ``AsyncCheckpointIO``, an already atomic plugin and object-store paths are left as they are. Strategies that
  write distributed checkpoint folders themselves (``ModelParallelStrategy``, sharded FSDP, DeepSpeed) bypass the
  plugin: while this callback writes such a folder, ``<dirpath>/checkpoint-is-incomplete.txt`` names it, so
  resume logic (``lit_trainer.callbacks.resume_choice``) skips it after a crash. The ``best/`` export is
  written in a temporary folder and renamed likewise.
* Under DDP the monitored value of global rank 0 decides (it is broadcast), so all ranks keep identical
  bookkeeping even when the metric is logged without ``sync_dist=True``. Log it with ``sync_dist=True`` (or a
  torchmetrics metric) to make the decision on the global value.
* Checkpoint and export loads are safe: ``weights_only``'s allowlist, with hyperparameters it refuses (a ``Path``, a
  class, a ``functools.partial``) left unbuilt rather than failing the load (:mod:`lit_trainer.checkpoint_load`).
* Under ``ModelParallelStrategy`` (FSDP2) checkpoints are distributed checkpoint folders: ``export_hf`` reads the
  folder on rank 0; ``load_best_at_end`` reads it on every rank (one full CPU copy per rank, briefly) and each rank
  keeps its own shards. Both refuse FSDP1 and DeepSpeed at setup.
* With a callback that validates other weights than the live ones (``BEMA(evaluate_with_bema=True)``, through the
  protocol in ``lit_trainer.callbacks.checkpointing._evaluated_weights``), each checkpoint keeps the live weights in
  ``state_dict`` (it still resumes training) and the scored weights under ``checkpoint["evaluated_weights"]``;
  ``load_best_at_end`` and ``export_hf`` use the scored ones. ``save_weights_only=True`` is then refused at setup.

Resume: the best path and score, and the list of kept checkpoints, are part of the callback state (Lightning's
``ModelCheckpoint.state_dict``, tensors and primitives only); they are restored when ``dirpath`` is unchanged.

How it sits on ``ModelCheckpoint`` (public extension points only, no private method overridden): ``save_top_k=-1``
so Lightning's own top-k bookkeeping never deletes; :meth:`check_monitor_top_k` broadcasts rank 0's value and says
yes only to a strict improvement; Lightning then names, records and saves the checkpoint; right after the hook that
saved it (``on_train_batch_end``, ``on_train_epoch_end`` or ``on_validation_end``) the callback makes every rank
agree on the path, exports, and applies ``save_total_limit`` through ``trainer.strategy.remove_checkpoint``.
``tests/test_lightning_private_api.py`` pins the parts of that flow it relies on.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from typing_extensions import override

from lit_trainer.callbacks.checkpointing._evaluated_weights import EVALUATED_WEIGHTS_KEY, weight_scorers
from lit_trainer.callbacks.checkpointing._files import load_checkpoint_state_dict, removable
from lit_trainer.callbacks.hf_export import export_hf, saved_tokenizer
from lit_trainer.checkpoint_io import with_atomic_writes, write_sentinel
from lit_trainer.core.atomic import is_local_path
from lit_trainer.core.lightning_namespace import PackageBound
from lit_trainer.core.sharding import load_full_state_dict

_IMPROVES = {"min": lambda new, best: new < best, "max": lambda new, best: new > best}
HF_EXPORT_DIRNAME = "best"


def infer_mode(monitor: str) -> Literal["min", "max"]:
    """The reference's default direction: lower is better for names ending in ``"loss"``.

    Args:
        monitor: The monitored metric name.

    Returns:
        ``"min"`` or ``"max"``.
    """
    return "min" if monitor.endswith("loss") else "max"


class _BestCheckpoint(PackageBound):
    """Save a checkpoint only when ``monitor`` improves; optionally keep N, load the best at the end, export for HF.

    Args:
        dirpath: Folder for checkpoints (default: the logger's ``checkpoints`` folder, as ``ModelCheckpoint``).
        filename: Checkpoint name template, as ``ModelCheckpoint`` (default ``"{epoch}-{step}"``).
        monitor: Logged metric to track (the reference's ``metric_for_best_model``). Required: ``None`` (which
            ``ModelCheckpoint`` accepts, to keep the last checkpoint) is refused, because without a score there is
            no best checkpoint to save, keep, load or export; for the last checkpoint use ``ModelCheckpoint``.
        mode: ``"min"`` or ``"max"``; ``None`` infers it from the name (``"min"`` for names ending in ``"loss"``).
        save_total_limit: Keep at most this many checkpoints (the newest), never deleting the best; ``None`` keeps
            all. Must be >= 1.
        load_best_at_end: Load the best checkpoint's weights into the module when training ends, on every rank.
        export_hf: Also write ``.model`` (and ``.tokenizer``) with ``save_pretrained`` to ``<dirpath>/best/`` at each
            new best, loadable by ``from_pretrained``. For a peft model: the adapter, as ``HFExport``.
        merge_adapters: With ``export_hf`` and a peft model, export the merged model instead of the adapter.
        save_weights_only: Save only the module weights (the checkpoint cannot resume training).
        every_n_train_steps: Check for a new best every N optimizer steps (deferred to the next validation when the
            metric comes from validation), as ``ModelCheckpoint``.
        every_n_epochs: Check every N epochs (default 1 when no other trigger is given), as ``ModelCheckpoint``.
        save_on_train_epoch_end: As ``ModelCheckpoint``.
        auto_insert_metric_name: As ``ModelCheckpoint``.
        verbose: Log each decision.

    Raises:
        ValueError: For a ``monitor`` that is not a metric name (``None``, ``""``), a bad ``mode`` or
            ``save_total_limit``; at setup, for ``export_hf`` without a
            ``.model.save_pretrained``, for ``load_best_at_end``/``export_hf`` under FSDP1 or DeepSpeed, for
            ``save_weights_only`` with a callback that validates other weights, or for two such callbacks.

    Example:
        >>> cb = BestCheckpoint(monitor="val_loss", save_total_limit=2, load_best_at_end=True)
        >>> cb.mode
        'min'
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str = "val_loss",
        mode: Literal["min", "max"] | None = None,
        save_total_limit: int | None = None,
        load_best_at_end: bool = False,
        export_hf: bool = False,
        save_weights_only: bool = False,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        auto_insert_metric_name: bool = True,
        verbose: bool = False,
        merge_adapters: bool = False,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(
                f"`BestCheckpoint(monitor={monitor!r})` is invalid: BestCheckpoint saves only when a logged metric "
                "improves, so it needs that metric's name (e.g. monitor='val_loss'). To keep the last checkpoint "
                "without a metric, use Lightning's ModelCheckpoint(monitor=None) instead."
            )
        if mode is not None and mode not in _IMPROVES:
            raise ValueError(f"`BestCheckpoint(mode={mode!r})` is invalid: use 'min', 'max' or None (inferred).")
        if save_total_limit is not None and (isinstance(save_total_limit, bool) or save_total_limit < 1):
            raise ValueError(
                f"`BestCheckpoint(save_total_limit={save_total_limit!r})` is invalid: use an int >= 1, or None to "
                "keep every checkpoint."
            )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=False,  # its own messages (Lightning's speak of a top-k)
            save_top_k=-1,
            save_weights_only=save_weights_only,
            mode=mode or infer_mode(monitor),
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
        )
        self.save_total_limit = save_total_limit
        self.load_best_at_end = load_best_at_end
        self.export_hf = export_hf
        self.merge_adapters = merge_adapters
        self._scorer: Any = None  # the callback whose validation scores other weights than the live ones
        self._verbose = verbose
        self._improved = False  # a new best was decided: the checkpoint being written is this callback's
        self._sentinel: Path | None = None  # marks a distributed checkpoint folder as incomplete while it is written

    def _unsupported(self, strategy: Any) -> bool:
        """``load_best_at_end`` and ``export_hf`` work under ModelParallelStrategy (distributed checkpoint folders)
        but not under FSDP1/DeepSpeed, whose checkpoints they do not read."""
        refused = isinstance(strategy, (self._ns.FSDPStrategy, self._ns.DeepSpeedStrategy))
        return refused and (self.load_best_at_end or self.export_hf)

    @property
    def hf_export_dir(self) -> str | None:
        """Where ``export_hf`` writes (``<dirpath>/best``), once ``dirpath`` is known."""
        return os.path.join(self.dirpath, HF_EXPORT_DIRNAME) if self.dirpath else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self._unsupported(trainer.strategy):
            raise ValueError(
                f"`BestCheckpoint(load_best_at_end={self.load_best_at_end}, export_hf={self.export_hf})` does not "
                f"support {type(trainer.strategy).__name__}: use one device, DDP or ModelParallelStrategy (FSDP2), "
                "or set both to False."
            )
        if self.export_hf and not callable(getattr(getattr(pl_module, "model", None), "save_pretrained", None)):
            raise ValueError(
                f"`BestCheckpoint(export_hf=True)` needs `{type(pl_module).__name__}.model` with a `save_pretrained` "
                "method (a transformers model); set export_hf=False for other modules."
            )
        self._check_scorers(trainer)
        if stage == "fit" and is_local_path(self.dirpath):  # atomic writes for every checkpoint file of the run
            trainer.strategy.checkpoint_io = with_atomic_writes(trainer.strategy.checkpoint_io)

    def _writes_folders(self, strategy: Any) -> bool:
        """Strategies that can write a distributed checkpoint folder themselves, not through ``checkpoint_io``."""
        return isinstance(strategy, (self._ns.ModelParallelStrategy, self._ns.FSDPStrategy, self._ns.DeepSpeedStrategy))

    def _check_scorers(self, trainer: pl.Trainer) -> None:
        """Find the callback (e.g. ``BEMA(evaluate_with_bema=True)``) whose scored weights the checkpoints keep."""
        scorers = weight_scorers(trainer.callbacks)
        names = [type(cb).__name__ for cb in scorers]
        if len(scorers) > 1:
            raise ValueError(
                f"BestCheckpoint: {names} all validate with other weights than the live ones, so the "
                "score belongs to no single set of weights; let only one of them evaluate its weights."
            )
        if scorers and self.save_weights_only:
            raise ValueError(
                f"`BestCheckpoint(save_weights_only=True)` cannot keep the weights {names[0]} scored "
                "beside the live ones; use save_weights_only=False (the checkpoint then resumes "
                "training with the live weights, and load_best_at_end / export_hf use the scored ones)."
            )
        self._scorer = scorers[0] if scorers else None

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """For this callback's own saves: mark a distributed checkpoint folder as incomplete until it is written,
        and put the weights the monitored score was measured on beside the live ``state_dict``."""
        if not self._improved:
            return
        if trainer.is_global_zero and self._writes_folders(trainer.strategy) and is_local_path(self.best_model_path):
            # ModelCheckpoint sets best_model_path before it saves; resume logic skips the folder this names
            path = Path(self.best_model_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._sentinel = write_sentinel(path.parent, path.name, trainer.global_step)
        if self._scorer is None:
            return
        weights = self._scorer.evaluated_weights()
        if weights is None:
            self._ns.rank_zero_warn(
                f"BestCheckpoint: {type(self._scorer).__name__}'s scored weights are not available at step "
                f"{trainer.global_step} (changed since the validation); this checkpoint keeps only "
                "the live weights. Save at validation (no every_n_train_steps with a validation metric)."
            )
            return
        live, copies = checkpoint["state_dict"], {}
        for key, value in weights.items():
            if key in live and id(value) not in copies:
                copies[id(value)] = value.detach().to("cpu", copy=True)
        # tied aliases (e.g. embedding and LM head) share one copy, as in the live state_dict
        checkpoint[EVALUATED_WEIGHTS_KEY] = {k: copies[id(v)] for k, v in weights.items() if k in live}

    @override
    def check_monitor_top_k(self, trainer: pl.Trainer, current: Tensor | None = None) -> bool:
        """Whether ``current`` (global rank 0's value, broadcast) strictly improves on the best score.

        ``current`` is the monitored entry of the candidates ``ModelCheckpoint`` then names the file and records
        the score with; rank 0's value is written into it so that every rank records the same score and name.
        """
        self._improved = False
        if current is None:
            return False
        value = float(trainer.strategy.broadcast(float(current)))
        if isinstance(current, Tensor):
            with torch.no_grad():
                current.copy_(torch.as_tensor(value, dtype=current.dtype))
        best = self.best_model_score
        self._improved = not math.isnan(value) and (best is None or _IMPROVES[self.mode](value, float(best)))
        if not self._improved and self._verbose:
            self._ns.rank_zero_info(
                f"BestCheckpoint: step {trainer.global_step}: {self.monitor}={value:.6g} did not "
                f"improve on the best {best}; nothing saved."
            )
        return self._improved

    # ModelCheckpoint saves from these three hooks; what follows a new best (rank agreement on the path, the HF
    # export, the rotation) runs right after the hook that saved it, on every rank
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        with self._after_new_best(trainer):
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._after_new_best(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._after_new_best(trainer):
            super().on_validation_end(trainer, pl_module)

    @contextlib.contextmanager
    def _after_new_best(self, trainer: pl.Trainer) -> Iterator[None]:
        self._improved = False
        try:
            yield
        finally:
            improved, self._improved = self._improved, False
        if improved:  # the same on every rank (decided from rank 0's value)
            self._on_new_best(trainer)

    def _on_new_best(self, trainer: pl.Trainer) -> None:
        path = trainer.strategy.broadcast(self.best_model_path)  # the file rank 0 wrote
        if path != self.best_model_path:  # a file name template with other metrics logged without sync_dist
            self.best_k_models = {(path if p == self.best_model_path else p): v for p, v in self.best_k_models.items()}
            self.best_model_path = path
        if self._sentinel is not None:
            self._sentinel.unlink(missing_ok=True)
            self._sentinel = None
        if self._verbose:
            self._ns.rank_zero_info(
                f"BestCheckpoint: step {trainer.global_step}: new best "
                f"{self.monitor}={float(self.best_model_score):.6g}, saved {path!r}"
            )
        if self.export_hf:
            self._export_hf(trainer, path)
        self._rotate(trainer)

    def _rotate(self, trainer: pl.Trainer) -> None:
        """Drop the oldest kept checkpoints beyond ``save_total_limit``, sparing the newest and the best."""
        saved = list(self.best_k_models)  # insertion order == save order (kept across resume)
        if self.save_total_limit is not None:
            protected = {saved[-1], self.best_model_path}
            excess = len(saved) - max(self.save_total_limit, len(protected))
            for path in [p for p in saved if p not in protected][: max(excess, 0)]:
                self.best_k_models.pop(path)
                if removable(path, self.dirpath, trainer.ckpt_path):
                    trainer.strategy.remove_checkpoint(path)  # global rank 0, through the checkpoint_io
        worst = (max if self.mode == "min" else min)(self.best_k_models, key=lambda p: float(self.best_k_models[p]))
        self.kth_best_model_path, self.kth_value = worst, self.best_k_models[worst]

    def _export_hf(self, trainer: pl.Trainer, checkpoint_path: str) -> None:
        """Write the checkpoint's ``model.*`` weights with ``save_pretrained`` (+ tokenizer) to ``best/``."""
        if trainer.is_global_zero:
            module = trainer.lightning_module
            prefix = "model."
            state = load_checkpoint_state_dict(checkpoint_path)
            weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            export_hf(
                module.model,
                saved_tokenizer(trainer, module),
                self.hf_export_dir,
                state_dict=weights,
                merge_adapters=self.merge_adapters,
            )
        trainer.strategy.barrier("BestCheckpoint._export_hf")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.load_best_at_end:
            self.load_best(trainer, pl_module)

    def load_best(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Load the best checkpoint's weights into ``pl_module`` on every rank.

        Args:
            trainer: The trainer (its strategy provides broadcast and barrier).
            pl_module: The module to load into.

        Returns:
            Whether weights were loaded (False, with a warning, when there is no best checkpoint file).
        """
        path = trainer.strategy.broadcast(self.best_model_path)
        trainer.strategy.barrier("BestCheckpoint.load_best")
        found = trainer.strategy.reduce_boolean_decision(bool(path) and os.path.exists(path), all=True)
        if not found:
            self._ns.rank_zero_warn(
                f"BestCheckpoint(load_best_at_end=True): no best checkpoint file ({path!r}) on every rank; the module "
                f"keeps its final weights. Was `{self.monitor}` logged during validation?"
            )
            return False
        # a module that saves partial checkpoints (peft: trainable weights only) sets strict_loading = False
        # full tensors on every rank; under FSDP2 each rank keeps its own shards of them
        load_full_state_dict(pl_module, load_checkpoint_state_dict(path), strict=pl_module.strict_loading)
        self._ns.rank_zero_info(
            f"BestCheckpoint: loaded the best weights ({self.monitor}={self.best_model_score}) from {path}"
        )
        return True


class BestCheckpoint(_BestCheckpoint, ModelCheckpoint):
    __doc__ = _BestCheckpoint.__doc__
