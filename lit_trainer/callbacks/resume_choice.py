"""Which checkpoint to resume from: the newest COMPLETE checkpoint (docs/design.md#atomic-checkpoints).

A checkpoint is complete unless the incomplete-save sentinel names it, its folder holds the sentinel, or the file is
not a whole zip archive (:func:`lit_trainer.checkpoint_io.incomplete_reason`).

:func:`resolve_resume_checkpoint` picks the newest complete checkpoint of one or more folders; :func:`resolve_resume`
implements the CLI's ``never | auto | <path>`` choice without Lightning's silent ``ckpt_path=None -> "last"`` resume
(docs/design.md#lightning-implicit-resume). Both serve any Lightning script (``lit_trainer.callbacks`` exports
them), and the ``lit-trainer`` command uses them too; so they live beside the callbacks, below the CLI
(docs/design.md#layers).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_trainer.checkpoint_io import incomplete_reason, sentinel_target
from lit_trainer.core.lightning_namespace import LIGHTNING, trainer_namespace

_PathLike = str | os.PathLike


def _checkpoints_in(dirpath: Path) -> list[Path]:
    if not dirpath.is_dir():
        return []
    return [p for p in dirpath.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".")]


def complete_checkpoints(dirpath: _PathLike | Sequence[_PathLike]) -> list[str]:
    """Every complete ``*.ckpt`` (file, or folder of a sharded checkpoint) in one or more folders, newest first.

    "Newest" is the latest modification time (as Lightning's ``ckpt_path="last"``), ties broken by name.
    Skipped, each with a warning that names it: the checkpoint named by a folder's
    ``checkpoint-is-incomplete.txt`` (a save that did not finish), a checkpoint folder holding that sentinel, and a
    file that is not a complete zip archive (truncated). Hidden names (``.x.ckpt.partial``) are never candidates.

    Args:
        dirpath: a folder or a list of folders; missing folders are fine.

    Example:
        >>> complete_checkpoints("/nonexistent")
        []
    """
    folders = [Path(dirpath)] if isinstance(dirpath, (str, os.PathLike)) else [Path(d) for d in dirpath]
    complete: set[Path] = set()
    for folder in folders:
        pending = sentinel_target(folder)
        candidates = _checkpoints_in(folder)
        if pending is not None and (folder / pending) not in candidates:  # the usual case: only a partial exists
            candidates.append(folder / pending)
        for path in candidates:
            reason = incomplete_reason(path, pending)
            if reason is None:
                complete.add(path)
            else:
                rank_zero_warn(f"Not resuming from the incomplete checkpoint {path}: {reason}.")
    return [str(p) for p in sorted(complete, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)]


def resolve_resume_checkpoint(dirpath: _PathLike | Sequence[_PathLike]) -> str | None:
    """The newest complete ``*.ckpt`` in one or more folders (see :func:`complete_checkpoints`), or ``None``.

    Example:
        >>> resolve_resume_checkpoint("/nonexistent") is None
        True
    """
    found = complete_checkpoints(dirpath)
    return found[0] if found else None


def implicit_resume_sources(trainer: pl.Trainer) -> list[str]:
    """Existing files that ``trainer.fit(ckpt_path=None)`` would silently load.

    See docs/design.md#lightning-implicit-resume.

    Lightning turns ``None`` into ``"last"`` when an ``OnExceptionCheckpoint`` is configured: it then loads the
    newest of that callback's file and the ``last*.ckpt`` files of the ``ModelCheckpoint`` folders. Under SLURM it
    turns ``None`` into ``"hpc"`` when ``<default_root_dir>/hpc_ckpt_*.ckpt`` exists.

    Args:
        trainer: the configured trainer (before ``fit``), a ``lightning.pytorch`` or a ``pytorch_lightning`` one.

    Returns:
        The paths found (empty when ``ckpt_path=None`` means a fresh start).
    """
    found: list[Path] = []
    if SLURMEnvironment.detect():
        found += sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))
    ns = trainer_namespace(trainer) or LIGHTNING  # a `pytorch_lightning` trainer holds its own package's callbacks
    on_exception = [cb for cb in trainer.callbacks if isinstance(cb, ns.OnExceptionCheckpoint)]
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


def checked_checkpoint(path: _PathLike, *, given: str, instead: str) -> str:
    """``path`` when it is a complete checkpoint; else a ``ValueError`` that says why, in the caller's words.

    Args:
        path: the checkpoint asked for.
        given: how the user asked for it (``"`resume='x.ckpt'`"``, ``"--ckpt_path x.ckpt"``).
        instead: what the user can pass instead.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{given} is invalid: {path} does not exist. Pass an existing checkpoint, or {instead}.")
    reason = incomplete_reason(path, sentinel_target(path.parent))
    if reason is not None:
        raise ValueError(f"{given} cannot be resumed: {reason}. Pass another checkpoint, or {instead}.")
    return str(path)


def _checked_path(path: Path) -> str:
    return checked_checkpoint(
        path,
        given=f"`resume={str(path)!r}`",
        instead="'auto' (the newest complete checkpoint of the run; incomplete ones are skipped) or 'never'",
    )
