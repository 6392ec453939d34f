"""Bit-exact resume: per-rank RNG states in the checkpoint, and choosing which checkpoint to resume from.

Lightning restores weights, optimizer, scheduler, loop counters, callback state and a stateful loader's position,
but not the random number generators (reference/lightning.md 1.8, probe c): :class:`ExactResume` adds them, per
rank. :func:`resolve_resume_checkpoint` picks the newest *complete* checkpoint of a folder (DESIGN.md rule 5), and
:func:`resolve_resume` implements the CLI's ``resume: never | auto | <path>`` option without Lightning's silent
``ckpt_path=None -> "last"`` resume (reference/lightning.md 1.3).
"""

from __future__ import annotations

import os
import random
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, Checkpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

SENTINEL_NAME = "checkpoint-is-incomplete.txt"
_TARGET_PREFIX = "target: "
_PathLike = str | os.PathLike


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


class ExactResume(Callback):
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
        if stage != TrainerFn.FITTING:
            return
        self._device, self._rank, self._trainer = trainer.strategy.root_device, trainer.global_rank, trainer
        self._before_validation = None
        # first, and the helper behind every other non-Checkpoint callback; rebinding (not mutating) the list
        # keeps the loop that calls this hook iterating the old one
        others = [cb for cb in trainer.callbacks if cb is not self and cb is not self._tail]
        at = next((i for i, cb in enumerate(others) if isinstance(cb, Checkpoint)), len(others))
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

    def __init__(self, owner: ExactResume) -> None:
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


# ---------------------------------------------------------------------------------------------------------------
# Sentinel protocol and the choice of a complete checkpoint
# ---------------------------------------------------------------------------------------------------------------


def write_sentinel(dirpath: _PathLike, target_name: str, step: int) -> Path:
    """Mark ``dirpath/target_name`` as being written: ``dirpath/checkpoint-is-incomplete.txt`` names it.

    Args:
        dirpath: the checkpoint folder.
        target_name: the file (or folder) name the checkpoint will have once complete.
        step: the global step being saved (for people reading the file).

    Returns:
        The sentinel's path.
    """
    sentinel = Path(dirpath) / SENTINEL_NAME
    sentinel.write_text(f"Checkpoint started at step {step} and in progress...\n{_TARGET_PREFIX}{target_name}\n")
    return sentinel


def sentinel_target(dirpath: _PathLike) -> str | None:
    """The checkpoint name an interrupted save left in ``dirpath``'s sentinel (``None``: no sentinel or unreadable)."""
    sentinel = Path(dirpath) / SENTINEL_NAME
    try:
        lines = sentinel.read_text().splitlines()
    except OSError:
        return None
    return next((line[len(_TARGET_PREFIX):] for line in lines if line.startswith(_TARGET_PREFIX)), None)


def _incomplete_reason(path: Path, pending: str | None) -> str | None:
    """Why ``path`` is not a usable checkpoint, or ``None`` when it is complete."""
    if path.name == pending:
        return f"its save was interrupted ({path.parent / SENTINEL_NAME} names it)"
    if path.is_dir():
        return f"its save was interrupted ({path / SENTINEL_NAME} is present)" if (path / SENTINEL_NAME).exists() else None
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a truncated one has no central directory
        return "it is truncated or not a torch checkpoint"
    return None


def _checkpoints_in(dirpath: Path) -> list[Path]:
    if not dirpath.is_dir():
        return []
    return [p for p in dirpath.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".")]


def resolve_resume_checkpoint(dirpath: _PathLike | Sequence[_PathLike]) -> str | None:
    """The newest complete ``*.ckpt`` (file, or folder of a sharded checkpoint) in one or more folders.

    "Newest" is the latest modification time (as Lightning's ``ckpt_path="last"``), ties broken by name.
    Skipped, each with a warning that names it: the checkpoint named by a folder's
    ``checkpoint-is-incomplete.txt`` (a save that did not finish), a checkpoint folder holding that sentinel, and a
    file that is not a complete zip archive (truncated). Hidden names (``.x.ckpt.partial``) are never candidates.

    Args:
        dirpath: a folder or a list of folders; missing folders are fine.

    Returns:
        The path as a string, or ``None`` when no complete checkpoint exists.

    Example:
        >>> resolve_resume_checkpoint("/nonexistent") is None
        True
    """
    folders = [Path(dirpath)] if isinstance(dirpath, (str, os.PathLike)) else [Path(d) for d in dirpath]
    complete: list[Path] = []
    for folder in folders:
        pending = sentinel_target(folder)
        candidates = _checkpoints_in(folder)
        if pending is not None and (folder / pending) not in candidates:  # the usual case: only a partial exists
            candidates.append(folder / pending)
        for path in candidates:
            reason = _incomplete_reason(path, pending)
            if reason is None:
                complete.append(path)
            else:
                rank_zero_warn(f"Not resuming from the incomplete checkpoint {path}: {reason}.")
    if not complete:
        return None
    return str(max(complete, key=lambda p: (p.stat().st_mtime_ns, p.name)))


def implicit_resume_sources(trainer: pl.Trainer) -> list[str]:
    """Existing files that ``trainer.fit(ckpt_path=None)`` would silently load (reference/lightning.md 1.3, 1.5).

    Lightning turns ``None`` into ``"last"`` when an ``OnExceptionCheckpoint`` is configured: it then loads the
    newest of that callback's file and the ``last*.ckpt`` files of the ``ModelCheckpoint`` folders. Under SLURM it
    turns ``None`` into ``"hpc"`` when ``<default_root_dir>/hpc_ckpt_*.ckpt`` exists.

    Args:
        trainer: the configured trainer (before ``fit``).

    Returns:
        The paths found (empty when ``ckpt_path=None`` means a fresh start).
    """
    found: list[Path] = []
    if SLURMEnvironment.detect():
        found += sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))
    on_exception = [cb for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
    if on_exception:
        found += [Path(cb.ckpt_path) for cb in on_exception if Path(cb.ckpt_path).exists()]
        folders = {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
        folders.add(Path(trainer.default_root_dir) / "checkpoints")
        found += [p for folder in sorted(folders) for p in sorted(folder.glob("last*.ckpt"))]
    return [str(p) for p in found]


def _fresh_start(trainer: pl.Trainer | None, resume: str) -> None:
    sources = implicit_resume_sources(trainer) if trainer is not None else []
    if sources:
        raise ValueError(
            f"`resume={resume!r}` asks for a fresh start, but Lightning would silently resume from {sources[0]} "
            "(`fit(ckpt_path=None)` becomes 'last' with an OnExceptionCheckpoint, or 'hpc' under SLURM). Use a new "
            "run folder, delete that file, pass `resume='auto'` or its path to continue that run, or remove "
            "the OnExceptionCheckpoint callback (JITCheckpoint covers preemption)."
        )


def _never(resume: str, dirpath: _PathLike | Sequence[_PathLike], trainer: pl.Trainer | None) -> None:
    _fresh_start(trainer, resume)


def _newest(resume: str, dirpath: _PathLike | Sequence[_PathLike], trainer: pl.Trainer | None) -> str | None:
    found = resolve_resume_checkpoint(dirpath)
    if found is None:
        rank_zero_info(f"`resume={resume!r}`: no complete checkpoint in {dirpath}; starting a fresh run.")
        _fresh_start(trainer, resume)
    return found


_POLICIES = {"never": _never, "auto": _newest, "last": _newest}


def resolve_resume(
    resume: str | os.PathLike | None, dirpath: _PathLike | Sequence[_PathLike], trainer: pl.Trainer | None = None
) -> str | None:
    """Turn the CLI's ``resume`` option (``"never"`` | ``"auto"`` | a path) into ``trainer.fit``'s ``ckpt_path``.

    Args:
        resume: ``"never"`` (or ``None``): a fresh run; ``"auto"`` (or ``"last"``): the newest complete checkpoint
            in ``dirpath``, else a fresh run; anything else: the path of a checkpoint to resume from.
        dirpath: the run's checkpoint folder(s) (e.g. ``JITCheckpoint``'s and ``ModelCheckpoint``'s ``dirpath``).
        trainer: the configured trainer; when given, a fresh start that Lightning would turn into a silent resume
            (see :func:`implicit_resume_sources`) raises instead.

    Returns:
        A checkpoint path, or ``None`` for a fresh start.

    Raises:
        ValueError: for a fresh start that Lightning would turn into a resume; for a path that does not exist or
            is incomplete.

    Example:
        >>> resolve_resume("never", "/nonexistent") is None
        True
    """
    key = "never" if resume is None else str(resume)
    if key in _POLICIES:
        return _POLICIES[key](key, dirpath, trainer)
    return _checked_path(Path(key))


def _checked_path(path: Path) -> str:
    if not path.exists():
        raise ValueError(
            f"`resume={str(path)!r}` is invalid: no such checkpoint. Pass an existing checkpoint path, 'auto' "
            "(the newest complete checkpoint of the run) or 'never'."
        )
    reason = _incomplete_reason(path, sentinel_target(path.parent))
    if reason is not None:
        raise ValueError(
            f"`resume={str(path)!r}` is invalid: {reason}. Pass 'auto' to use the newest complete checkpoint."
        )
    return str(path)
