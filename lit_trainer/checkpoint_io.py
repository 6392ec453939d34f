"""AtomicCheckpointIO: every checkpoint file is written under a hidden partial name, then renamed into place.

What Lightning's own ``TorchCheckpointIO`` already guarantees (lightning 2.6): it serialises the whole checkpoint
into an in-memory buffer first, so an error inside ``torch.save`` (an object that cannot be pickled) writes
nothing. The buffer is then written inside an fsspec transaction; for a local path fsspec writes it to a file made
by ``tempfile.mkstemp`` (the system temporary folder, ``$TMPDIR``) and moves that file onto the target with
``shutil.move``. That move is a rename, hence atomic, only when the temporary folder and the checkpoint folder are
on the same file system. When they are not (a ``/tmp`` in memory or on the local disk, checkpoints on a network or
scratch volume: the usual cluster layout), ``shutil.move`` copies the bytes into the target name and then deletes
the temporary file, so a process killed during the copy leaves a truncated file under the final name, which a
resume then picks up. Nothing is flushed to disk either (no ``fsync``), so a power loss can leave an empty file
under the final name even after a rename.

:class:`AtomicCheckpointIO` closes that gap for local paths with the protocol of :mod:`lit_trainer.core.atomic`: the
wrapped plugin writes ``<dir>/.<name>.partial`` (same folder, so same file system), the file is flushed, renamed
onto ``<dir>/<name>`` with ``os.replace`` and the folder entry is flushed. A crash at any point leaves either the
previous file or no file under the final name, never part of one; the hidden partial name matches no checkpoint
glob and ``lit_trainer.core.atomic.remove_partials`` cleans it up. A write that fails with an ``OSError`` (a full disk,
an I/O error) removes its partial file before the error goes on; a full disk (or quota) is reported as a one-line
:class:`lit_trainer.core.atomic.NoSpaceError` naming the file, its folder, about how many bytes the checkpoint needs
(its tensors' sizes) and the space free. Paths with a protocol (``s3://``, ``gs://``) go to
the wrapped plugin unchanged (object stores publish an upload only once it is complete).

Use it directly (``Trainer(plugins=[AtomicCheckpointIO()])``, or around your own plugin:
``AtomicCheckpointIO(MyCheckpointIO())``; for ``pytorch_lightning.Trainer`` import it from
``lit_trainer.callbacks.pytorch_lightning``), or let ``BestCheckpoint`` install it (see its docs). It applies to
everything a strategy writes through its ``checkpoint_io``: single-device and DDP checkpoints, and full-state
files of FSDP. Distributed checkpoint folders (``ModelParallelStrategy``, sharded FSDP, DeepSpeed) are written by
the strategy itself, not through the plugin.

**The incomplete-save sentinel.** A checkpoint that is not one file renamed into place (a sharded folder, or any
save a callback wants to flag while it runs) is announced first: :func:`write_sentinel` writes
``<dir>/checkpoint-is-incomplete.txt`` naming the target, the callback deletes it once the save is complete, and
:func:`incomplete_reason` tells a reader (the resume logic in :mod:`lit_trainer.callbacks.resume_choice`) why a
candidate is not usable.

Example:
    >>> import os, tempfile
    >>> io = AtomicCheckpointIO()
    >>> path = os.path.join(tempfile.mkdtemp(), "step=1.ckpt")
    >>> io.save_checkpoint({"step": 1}, path)
    >>> sorted(os.listdir(os.path.dirname(path))), io.load_checkpoint(path)["step"]
    (['step=1.ckpt'], 1)
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from typing_extensions import override

from lit_trainer.core.atomic import commit, discard, is_local_path, is_out_of_space, no_space_error, partial_path

SENTINEL_NAME = "checkpoint-is-incomplete.txt"
_TARGET_PREFIX = "target: "
_PathLike = str | os.PathLike


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
    return next((line[len(_TARGET_PREFIX) :] for line in lines if line.startswith(_TARGET_PREFIX)), None)


def incomplete_reason(path: Path, pending: str | None) -> str | None:
    """Why ``path`` is not a usable checkpoint, or ``None`` when it is complete."""
    if path.name == pending:
        return f"its save was interrupted ({path.parent / SENTINEL_NAME} names it)"
    if path.is_dir():
        return (
            f"its save was interrupted ({path / SENTINEL_NAME} is present)" if (path / SENTINEL_NAME).exists() else None
        )
    if path.is_file() and path.stat().st_size == 0:
        return "it is empty (0 bytes: a save that never wrote, or a copy that failed)"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a truncated one has no central directory
        return f"it is truncated or not a torch checkpoint ({path.stat().st_size:,} bytes, not a whole zip archive)"
    return None


def checkpoint_bytes(checkpoint: Any) -> int:
    """About how many bytes ``torch.save`` writes for ``checkpoint``: the sizes of the tensors' storages it holds,
    each storage once (a checkpoint is almost all tensors; the rest is a few kilobytes of pickle).

    Example:
        >>> checkpoint_bytes({"state_dict": {"w": torch.zeros(256, 256)}, "step": 3})
        262144
    """
    seen: set[int] = set()
    total = 0
    stack = [checkpoint]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, some subclasses)
                continue
            key = storage.data_ptr() or id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def is_async(checkpoint_io: Any) -> bool:
    """Whether ``checkpoint_io`` is an ``AsyncCheckpointIO`` (of either Lightning package) writing in a thread."""
    modules = [sys.modules.get(name) for name in ("lightning.pytorch.plugins.io", "pytorch_lightning.plugins.io")]
    return isinstance(checkpoint_io, tuple(m.AsyncCheckpointIO for m in modules if m is not None))


class _AtomicCheckpointIO:
    """The implementation of :class:`AtomicCheckpointIO`, without a Lightning base (one class per package)."""

    def __init__(self, checkpoint_io: CheckpointIO | None = None, fsync: bool = True) -> None:
        super().__init__()
        checkpoint_io = TorchCheckpointIO() if checkpoint_io is None else checkpoint_io
        if not callable(getattr(checkpoint_io, "save_checkpoint", None)):
            raise TypeError(
                f"`AtomicCheckpointIO(checkpoint_io={checkpoint_io!r})` needs a CheckpointIO plugin "
                "(an object with save_checkpoint/load_checkpoint/remove_checkpoint)."
            )
        if is_async(checkpoint_io):
            raise TypeError(
                "`AtomicCheckpointIO(AsyncCheckpointIO(...))` cannot rename a file that is still being "
                "written in the background; wrap the synchronous plugin instead."
            )
        self.checkpoint_io = checkpoint_io
        self.fsync = fsync

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` through the wrapped plugin, atomically for local paths.

        Args:
            checkpoint: The checkpoint dict (as built by ``Trainer.save_checkpoint``).
            path: The final path; the data appears under it only once completely written.
            storage_options: Passed to the wrapped plugin.

        Raises:
            NoSpaceError: The file system is full (or over quota); the partial file was removed and ``path`` is as
                it was. Any other ``OSError`` of the write also removes the partial file, then goes on unchanged.
        """
        if not is_local_path(path):
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        tmp = partial_path(path)
        try:
            self.checkpoint_io.save_checkpoint(
                checkpoint, str(tmp) if isinstance(path, str) else tmp, storage_options=storage_options
            )
            commit(tmp, path, fsync=self.fsync)
        except OSError as error:  # a failed write (a killed process leaves the partial file to remove_partials)
            discard(tmp)
            if is_out_of_space(error):
                raise no_space_error(error, "the checkpoint", path, checkpoint_bytes(checkpoint)) from error
            raise

    @override
    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load with the wrapped plugin (its own defaults, e.g. ``map_location``, apply)."""
        return self.checkpoint_io.load_checkpoint(path, *args, **kwargs)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove with the wrapped plugin."""
        self.checkpoint_io.remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        """Tear the wrapped plugin down."""
        self.checkpoint_io.teardown()


class AtomicCheckpointIO(_AtomicCheckpointIO, CheckpointIO):
    """A ``CheckpointIO`` that makes another one's local writes atomic (write a partial name, then rename).

    Args:
        checkpoint_io: The plugin that serialises and writes the checkpoint (default: Lightning's
            ``TorchCheckpointIO``). It must write synchronously to the path it is given (not an
            ``AsyncCheckpointIO``, whose write would still be running when the rename happens).
        fsync: Flush the file and its folder to disk around the rename (survives a power loss).

    Raises:
        TypeError: If ``checkpoint_io`` is not a ``CheckpointIO`` or writes in the background.
    """


def with_atomic_writes(checkpoint_io: Any) -> Any:
    """``checkpoint_io`` wrapped in :class:`AtomicCheckpointIO`, or itself when it is already atomic or writes in the
    background (``AsyncCheckpointIO``: its file is still being written when ``save_checkpoint`` returns)."""
    if isinstance(checkpoint_io, _AtomicCheckpointIO) or is_async(checkpoint_io):
        return checkpoint_io
    return AtomicCheckpointIO(checkpoint_io)


def atomic_checkpoint_io_class(checkpoint_io_base: type) -> type:
    """:class:`AtomicCheckpointIO` on another package's ``CheckpointIO`` base (``lightning_fabric`` for
    ``pytorch_lightning``, whose trainer only accepts plugins of its own package)."""
    return type(
        "AtomicCheckpointIO", (_AtomicCheckpointIO, checkpoint_io_base), {"__doc__": AtomicCheckpointIO.__doc__}
    )
