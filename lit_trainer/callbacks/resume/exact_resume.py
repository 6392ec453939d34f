"""Bit-exact resume: per-rank RNG states, loader replay and window gradients in the checkpoint.

Lightning restores weights, optimizer, scheduler, loop counters, callback state and a stateful loader's position,
but not the random number generators, not the position of a plain ``DataLoader`` and not the gradients of an
accumulation window in progress: :class:`ExactResume` adds the three (``docs/resume.md`` lists what is exact).
:func:`resolve_resume_checkpoint` picks the newest *complete* checkpoint of a folder, and :func:`resolve_resume`
implements the CLI's ``resume: never | auto | <path>`` option without Lightning's silent ``ckpt_path=None -> "last"``
resume (:mod:`lit_trainer.callbacks.resume_choice`).

The callback is here; its private parts beside it: the RNG states (``_rng_state``), the replay of a plain
``DataLoader`` epoch (``_replay_loader``) and the gradients of an accumulation window in progress (``_window_grads``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lit_trainer.callbacks.resume._replay_loader import (
    REPLAY_MARKER,
    ReplayLoader,
    can_skip_by_index,
    loader_generators,
)
from lit_trainer.callbacks.resume._rng_state import (
    RawRngState,
    apply_rng_state,
    capture_rng,
    restore_rng,
    rng_state_to_dict,
)
from lit_trainer.callbacks.resume._window_grads import (
    collect_window_grads,
    grads_are_local,
    mid_window_validation_error,
    restore_window_grads,
    window_in_progress,
)
from lit_trainer.core.dist import gather_from_all_ranks, gather_to_rank_zero
from lit_trainer.core.lightning_namespace import PackageBound


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _set_generator_states(loader: DataLoader, states: list[torch.Tensor]) -> None:
    for generator, state in zip(loader_generators(loader), states, strict=False):  # a changed loader: warned elsewhere
        generator.set_state(state)


def _strip_replay_markers(checkpoint: dict[str, Any]) -> None:
    """Remove the (empty) states of :class:`ReplayLoader` wrappers from the fit loop's saved loader states, so the
    checkpoint resumes like any other, with or without ExactResume."""
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = fit_state.get("combined_loader")
    if not states:
        return
    kept = [x for x in states if not (isinstance(x, Mapping) and REPLAY_MARKER in x)]
    if kept:
        fit_state["combined_loader"] = kept
    else:
        del fit_state["combined_loader"]


class _ExactResume(PackageBound):
    """Save and restore what Lightning does not, so that a resumed run is the same run, bit for bit.

    What it does (``docs/resume.md`` has the table of exact and refused cases):

    * ``state_dict()`` gathers each rank's RNG states (python, numpy, torch, CUDA) to every rank, so the checkpoint
      Lightning writes from rank 0 holds ``{"world_size": W, "ranks": [state_0, ..., state_W-1]}``. Under DDP this
      is a collective: save checkpoints with ``trainer.save_checkpoint`` on every rank (Lightning requires it).
    * The loaded states are applied in the first ``on_train_batch_start`` after the restore, right before the first
      resumed forward (``load_state_dict`` is too early: the loaders are set up after it). The callback moves itself
      to the front of ``trainer.callbacks`` at setup so that no other callback's ``on_train_batch_start`` draws from
      the generators before they are restored.
    * A plain training ``DataLoader`` (not stateful) is wrapped in a :class:`ReplayLoader` at train start: the RNG
      states that build each epoch's iterator are recorded, and a resume rebuilds the interrupted epoch's iterator
      from them (same permutation, same worker seeds) and skips the batches already trained by index, without
      loading them. A resume at an epoch boundary builds the next epoch's iterator from the checkpoint's states.
    * A checkpoint written inside an accumulation window (a validation between two micro-batches of one step)
      also holds every rank's accumulated gradients, put back before the resumed window's next backward.
    * Validation during ``fit`` is isolated from the training RNG stream: the states are recorded after the other
      callbacks' ``on_train_batch_end`` and put back after their ``on_validation_end`` (a small helper callback
      placed behind them does both), so a validation's draws, including the one a plain validation ``DataLoader``
      makes when Lightning creates its iterator before any validation hook, never reach training. A checkpoint
      written during validation records the pre-validation states.
    * It warns, saying what is lost, when a training loader is neither stateful nor a ``DataLoader``, when a
      mid-epoch resume must read an iterable dataset forward or restarts worker processes, when the checkpoint has
      no ExactResume state or another world size, and when a sharded strategy saves inside a window.

    Not covered: draws from the global generators outside training and validation steps by other code (a
    callback's ``on_train_epoch_end``, a collate function using ``torch.rand``); give such code its own generator.

    Example::

        trainer = Trainer(callbacks=[ExactResume(), JITCheckpoint()], use_distributed_sampler=False)
        trainer.fit(module, datamodule, ckpt_path=resolve_resume("auto", "runs/x/checkpoints"))
    """

    def __init__(self) -> None:
        super().__init__()
        self._device: torch.device | None = None
        self._rank = 0
        self._trainer: pl.Trainer | None = None
        self._loaded: dict[str, Any] | None = None
        self._rng_applied = False  # the loaded states already built the resumed epoch (a resume at its start)
        self._replayed: set[int] = set()
        self._replays: list[ReplayLoader] = []
        self._before_validation: RawRngState | None = None
        self._tail = _ExactResumeTail(self)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # checks the trainer's Lightning package
        if stage != TrainerFn.FITTING:
            return
        self._device, self._rank, self._trainer = trainer.strategy.root_device, trainer.global_rank, trainer
        self._before_validation, self._replays = None, []
        # first, and the helper behind every other non-Checkpoint callback; rebinding (not mutating) the list
        # keeps the loop that calls this hook iterating the old one
        others = [cb for cb in trainer.callbacks if cb is not self and cb is not self._tail]
        at = next((i for i, cb in enumerate(others) if isinstance(cb, self._ns.Checkpoint)), len(others))
        trainer.callbacks = [self] + others[:at] + [self._tail] + others[at:]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refusal = mid_window_validation_error(
            type(trainer.strategy).__name__,
            grads_are_local(trainer, self._ns),
            trainer.accumulate_grad_batches,
            trainer.val_check_batch,
            trainer.enable_validation and any(isinstance(cb, self._ns.Checkpoint) for cb in trainer.callbacks),
        )
        if refusal:
            raise ValueError(refusal)
        self._install_replay(trainer, rebuild_iterator=True)
        combined = trainer.fit_loop._combined_loader  # its flat list of the training loaders, as Lightning keeps it
        unresumable = [
            type(x).__name__
            for x in (combined.flattened if combined is not None else [])
            if not _is_stateful(x) and not isinstance(x, DataLoader)
        ]
        if unresumable:
            rank_zero_warn(
                f"ExactResume: the training loader ({', '.join(unresumable)}) is neither a `DataLoader` nor has "
                "`state_dict`/`load_state_dict`, so its position and order cannot be restored: a run resumed "
                "mid-epoch replays that epoch from its first batch and is not exact. Use a `DataLoader`, "
                "`lit_trainer.data.loader.TrainLoader` or another stateful loader."
            )
        if trainer.ckpt_path is not None and self._loaded is None:
            rank_zero_warn(
                f"ExactResume: the checkpoint {trainer.ckpt_path} has no ExactResume state (it was saved without this "
                "callback), so the random number generators are not restored and the resumed run is not exact."
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a loader reloaded for this epoch (`reload_dataloaders_every_n_epochs`); its iterator is built after this hook
        self._install_replay(trainer, rebuild_iterator=False)

    def _install_replay(self, trainer: pl.Trainer, rebuild_iterator: bool) -> None:
        """Wrap the fit loop's plain training ``DataLoader`` objects (after Lightning prepared them: distributed
        sampler, worker seeding) and, at train start, rebuild the epoch iterator Lightning already made."""
        combined = trainer.fit_loop._combined_loader
        if combined is None:
            return
        flat = combined.flattened
        wrapped = [
            ReplayLoader(x, self, i) if isinstance(x, DataLoader) and not _is_stateful(x) else x
            for i, x in enumerate(flat)
        ]
        if all(a is b for a, b in zip(wrapped, flat, strict=True)):
            return
        combined.flattened = wrapped
        self._replays = [x for x in wrapped if isinstance(x, ReplayLoader)]
        if rebuild_iterator and trainer.fit_loop._data_fetcher is not None:
            iter(trainer.fit_loop._data_fetcher)  # the wrappers build nothing until the epoch's first batch

    # ------------------------------------------------------------------------------------- plain DataLoader replay
    def _current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    def _capture_loader_states(self, loader: DataLoader) -> dict[str, Any]:
        """The global generators and ``loader``'s own generators, now."""
        return {
            "rng": rng_state_to_dict(capture_rng(self._device)),
            "generators": [g.get_state() for g in loader_generators(loader)],
        }

    def _restore_loader_states(self, loader: DataLoader, state: Mapping[str, Any]) -> None:
        apply_rng_state(state["rng"], self._device)
        _set_generator_states(loader, state["generators"])

    def _own_state(self) -> dict[str, Any] | None:
        ranks = self._loaded["ranks"] if self._loaded is not None else []
        return ranks[self._rank] if self._rank < len(ranks) else None

    def _begin_replay_epoch(self, replay: ReplayLoader) -> int:
        """Called by a :class:`ReplayLoader` when it builds an epoch's iterator: on the first epoch after a restore,
        put back the states that built the interrupted epoch and return the number of batches to skip."""
        trainer = self._trainer
        if trainer is None or self._loaded is None or replay.index in self._replayed:
            return 0
        self._replayed.add(replay.index)
        own = self._own_state()
        saved = (own or {}).get("loaders", {}).get(str(replay.index))
        consumed = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # Lightning resumes the epoch here
        if consumed == 0:  # an epoch boundary: the checkpoint's states build the next epoch, as in the first run
            if own is not None and not self._rng_applied:
                apply_rng_state(own, self._device)
                self._rng_applied = True
            if saved is not None:
                _set_generator_states(replay.loader, saved["generators"])
            return 0
        name = f"training loader {replay.index} ({type(replay.loader).__name__})"
        if saved is None or saved["epoch"] != trainer.current_epoch:
            rank_zero_warn(
                f"ExactResume: the checkpoint does not hold the RNG states that built epoch "
                f"{trainer.current_epoch} of the {name} (it was written without ExactResume's replay), so "
                "the resumed epoch's order differs from the first run's: not exact."
            )
        else:
            self._restore_loader_states(replay.loader, saved["start"])
        if not can_skip_by_index(replay.loader):
            rank_zero_warn(
                f"ExactResume: the {name} iterates an IterableDataset, which has no index to skip by: "
                f"the {consumed} batches already trained are read again and dropped. The resumed run is "
                "exact only if the dataset's stream depends on nothing but the restored RNG states."
            )
        if replay.loader.num_workers > 0:
            rank_zero_warn(
                f"ExactResume: the {name} loads in {replay.loader.num_workers} worker processes, which "
                "restart with the epoch's seeds after the skipped batches: randomness drawn inside the "
                "dataset or `collate_fn` (random augmentation) differs from the first run for the rest of "
                "this epoch. Draw it in the training step, or load in the main process, to stay exact."
            )
        return consumed

    # ------------------------------------------------------------------------------------------- restore, save
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._loaded is None:
            return
        own, loaded = self._own_state(), self._loaded
        self._loaded, applied, self._rng_applied = None, self._rng_applied, False
        self._replayed.clear()
        states = loaded["ranks"]
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"ExactResume: the checkpoint was saved by {len(states)} rank(s) and this run has "
                f"{trainer.world_size}; ranks without a saved state keep their seeded generators, so the resumed run "
                "is not exact."
            )
        if own is not None and not applied:
            apply_rng_state(own, self._device)
        grads = loaded.get("window_grads")
        if grads and len(grads) == trainer.world_size:
            restore_window_grads(pl_module, grads[self._rank])

    def _in_fit_validation(self) -> bool:
        trainer = self._trainer
        return (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.validating
            and not trainer.sanity_checking
            and self._before_validation is not None
        )

    def _window_grads(self) -> dict[str, torch.Tensor] | None:
        """This rank's gradients when the checkpoint is written inside an accumulation window, else None."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not window_in_progress(trainer):
            return None
        if not grads_are_local(trainer, self._ns):
            rank_zero_warn(
                f"ExactResume: a checkpoint is written inside an accumulation window under "
                f"{type(trainer.strategy).__name__}, whose gradients are sharded or held by the strategy: "
                "they are not saved, so a run resumed from it loses the window's first micro-batches. "
                "Validate and checkpoint at optimizer-step boundaries (`val_check_interval` a multiple of "
                "`accumulate_grad_batches`)."
            )
            return None
        return collect_window_grads(trainer.lightning_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        raw = self._before_validation if self._in_fit_validation() else capture_rng(self._device)
        local = rng_state_to_dict(raw)
        local["loaders"] = {
            str(r.index): {
                "epoch": r.epoch,
                "start": r.epoch_start,
                "generators": [g.get_state() for g in loader_generators(r.loader)],
            }
            for r in self._replays
            if r.epoch_start is not None
        }
        ranks = gather_from_all_ranks(local)
        state: dict[str, Any] = {"world_size": len(ranks), "ranks": ranks}
        grads = self._window_grads()
        if grads is not None:
            state["window_grads"] = gather_to_rank_zero(grads)  # rank 0 writes the checkpoint
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        _strip_replay_markers(checkpoint)


class _ExactResumeTail(Callback):
    """ExactResume's helper behind the other callbacks: records the states after a training batch's hooks and
    puts them back after a validation's hooks (stateless, so Lightning does not checkpoint it)."""

    def __init__(self, owner: _ExactResume) -> None:
        super().__init__()
        self.owner = owner

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.owner._before_validation = capture_rng(self.owner._device)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.owner._in_fit_validation():
            restore_rng(self.owner._before_validation, self.owner._device)  # type: ignore[arg-type]


class ExactResume(_ExactResume, Callback):
    __doc__ = _ExactResume.__doc__
