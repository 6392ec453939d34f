"""Bit-exact resume: per-rank RNG states in the checkpoint (checkpoint choice: :mod:`.checkpoint_resolution`).

Lightning restores weights, optimizer, scheduler, loop counters, callback state and a stateful loader's position,
but not the random number generators (reference/lightning.md 1.8, probe c): :class:`ExactResume` adds them, per
rank. :func:`resolve_resume_checkpoint` picks the newest *complete* checkpoint of a folder (DESIGN.md rule 5), and
:func:`resolve_resume` implements the CLI's ``resume: never | auto | <path>`` option without Lightning's silent
``ckpt_path=None -> "last"`` resume (reference/lightning.md 1.3).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_trainer.callbacks._namespace import PackageBound
from lit_trainer.callbacks.checkpoint_resolution import (  # noqa: F401 (re-exported)
    SENTINEL_NAME,
    implicit_resume_sources,
    resolve_resume,
    resolve_resume_checkpoint,
    sentinel_target,
    write_sentinel,
)


# ---------------------------------------------------------------------------------------------------------------
# RNG states as tensors and primitives (checkpoints load with weights_only=True)
# ---------------------------------------------------------------------------------------------------------------


RawRngState = tuple[Any, Any, torch.Tensor, "torch.Tensor | None"]


def capture_rng(device: torch.device | None = None) -> RawRngState:
    """The generator states as the libraries return them (cheap: called after every training batch).

    Args:
        device: the rank's device; its CUDA generator is included when it is a CUDA device.

    Returns:
        ``(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda state or None)``.
    """
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def restore_rng(raw: RawRngState, device: torch.device | None = None) -> None:
    """Set the generators to a state from :func:`capture_rng` (the CUDA one only on a CUDA ``device``)."""
    random.setstate(raw[0])
    np.random.set_state(raw[1])
    torch.set_rng_state(raw[2])
    if raw[3] is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(raw[3], device)


def rng_state_to_dict(raw: RawRngState) -> dict[str, Any]:
    """Tensors and primitives only (numpy's key vector as an int64 tensor), so ``weights_only=True`` loads it."""
    version, internal, gauss_next = raw[0]
    _, keys, pos, has_gauss, cached = raw[1]
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": raw[2],
    }
    if raw[3] is not None:
        state["cuda"] = raw[3]
    return state


def rng_state_from_dict(state: Mapping[str, Any]) -> RawRngState:
    """The inverse of :func:`rng_state_to_dict`."""
    py, npy = state["python"], state["numpy"]
    numpy_state = ("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                   npy["cached_gaussian"])
    return (py["version"], tuple(py["state"].tolist()), py["gauss_next"]), numpy_state, state["torch"], state.get("cuda")


def collect_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's python, numpy, torch and (on a CUDA ``device``) CUDA generator states, as a plain dict."""
    return rng_state_to_dict(capture_rng(device))


def apply_rng_state(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Set the generators to a state made by :func:`collect_rng_state`."""
    restore_rng(rng_state_from_dict(state), device)


def _gather_from_all_ranks(local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's object, in rank order (a collective under an initialised process group of size > 1)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def _flat_loaders(loaders: Any) -> list[Any]:
    if isinstance(loaders, Mapping):
        return [x for v in loaders.values() for x in _flat_loaders(v)]
    if isinstance(loaders, (list, tuple)):
        return [x for v in loaders for x in _flat_loaders(v)]
    return [] if loaders is None else [loaders]


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class _ExactResume(PackageBound):
    """Save and restore every rank's RNG states so that a resumed run is the same run.

    What it does:

    * ``state_dict()`` gathers each rank's states (python, numpy, torch, CUDA) to every rank, so the checkpoint
      Lightning writes from rank 0 holds ``{"world_size": W, "ranks": [state_0, ..., state_W-1]}``. Under DDP this
      is a collective: save checkpoints with ``trainer.save_checkpoint`` on every rank (Lightning requires it).
    * The loaded states are applied in the first ``on_train_batch_start`` after the restore, right before the first
      resumed forward (``load_state_dict`` is too early: the loaders are set up after it; probe c). The callback
      moves itself to the front of ``trainer.callbacks`` at setup so that no other callback's
      ``on_train_batch_start`` draws from the generators before they are restored.
    * Validation during ``fit`` is isolated from the training RNG stream: the states are recorded after the other
      callbacks' ``on_train_batch_end`` and put back after their ``on_validation_end`` (a small helper callback
      placed behind them does both), so a validation's draws, including the one a plain validation ``DataLoader``
      makes when Lightning creates its iterator before any validation hook, never reach training. A checkpoint
      written during validation records the pre-validation states. Whether a validation runs, re-runs or is
      skipped around a resume then never shifts training randomness.
    * At train start it warns when a training loader is not stateful (a plain ``DataLoader``): Lightning then
      replays the interrupted epoch from batch 0, so a mid-epoch resume cannot be exact. It also warns when the
      run resumes from a checkpoint without ``ExactResume`` state, or with a different world size.

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
        self._before_validation: RawRngState | None = None
        self._tail = _ExactResumeTail(self)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # checks the trainer's Lightning package
        if stage != TrainerFn.FITTING:
            return
        self._device, self._rank, self._trainer = trainer.strategy.root_device, trainer.global_rank, trainer
        self._before_validation = None
        # first, and the helper behind every other non-Checkpoint callback; rebinding (not mutating) the list
        # keeps the loop that calls this hook iterating the old one
        others = [cb for cb in trainer.callbacks if cb is not self and cb is not self._tail]
        at = next((i for i, cb in enumerate(others) if isinstance(cb, self._ns.Checkpoint)), len(others))
        trainer.callbacks = [self] + others[:at] + [self._tail] + others[at:]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        unresumable = [type(x).__name__ for x in _flat_loaders(trainer.train_dataloader) if not _is_stateful(x)]
        if unresumable:
            rank_zero_warn(
                f"ExactResume: the training loader ({', '.join(unresumable)}) has no `state_dict`/`load_state_dict`, "
                "so its position cannot be restored: a run resumed mid-epoch replays that epoch from batch 0 and is "
                "not exact. Use `lit_trainer.data.loader.TrainLoader` or another stateful loader."
            )
        if trainer.ckpt_path is not None and self._loaded is None:
            rank_zero_warn(
                f"ExactResume: the checkpoint {trainer.ckpt_path} has no ExactResume state (it was saved without this "
                "callback), so the random number generators are not restored and the resumed run is not exact."
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._loaded is None:
            return
        loaded, self._loaded = self._loaded, None
        states = loaded["ranks"]
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"ExactResume: the checkpoint was saved by {len(states)} rank(s) and this run has {trainer.world_size}; "
                "ranks without a saved state keep their seeded generators, so the resumed run is not exact."
            )
        if self._rank < len(states):
            apply_rng_state(states[self._rank], self._device)

    def _in_fit_validation(self) -> bool:
        trainer = self._trainer
        return (trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.validating
                and not trainer.sanity_checking and self._before_validation is not None)

    @override
    def state_dict(self) -> dict[str, Any]:
        raw = self._before_validation if self._in_fit_validation() else capture_rng(self._device)
        ranks = _gather_from_all_ranks(rng_state_to_dict(raw))
        return {"world_size": len(ranks), "ranks": ranks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict


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
