"""Reading and deleting ``BestCheckpoint``'s files: the scored weights of a checkpoint, and the rotation's rule for
which files may be deleted."""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor

from lit_trainer.callbacks.checkpointing._evaluated_weights import scored_state_dict
from lit_trainer.checkpoint_load import load_checkpoint
from lit_trainer.core.atomic import is_local_path


def load_checkpoint_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The weights a Lightning checkpoint was scored with, loaded safely (:func:`lit_trainer.checkpoint_load.
    load_checkpoint`: ``weights_only``'s allowlist; hyperparameters it refuses, such as a ``Path``, a class or a
    ``functools.partial``, are left unbuilt instead of failing the load).

    Args:
        path: A ``.ckpt`` file written by ``Trainer.save_checkpoint``, or the directory of a distributed checkpoint
            (``ModelParallelStrategy``), whose shards are all read into full tensors (one full copy in CPU memory).

    Returns:
        The ``"state_dict"`` entry (CPU tensors, memory-mapped), with the weights a callback such as
        ``BEMA(evaluate_with_bema=True)`` validated in place of the live ones, when the checkpoint holds them.

    Raises:
        RuntimeError: If the file cannot be read even so (the message says why).
    """
    if Path(path).is_dir():  # a distributed checkpoint (ModelParallelStrategy): every shard, read by this process
        from lightning.fabric.utilities.load import _load_distributed_checkpoint

        return scored_state_dict(_load_distributed_checkpoint(Path(path)))
    try:
        checkpoint = load_checkpoint(path, mmap=True)
    except Exception as err:
        raise RuntimeError(f"BestCheckpoint could not read {str(path)!r}: {err}") from err
    return scored_state_dict(checkpoint)


def removable(path: str, dirpath: str | os.PathLike | None, resume_path: str | os.PathLike | None) -> bool:
    """Whether rotation may delete ``path``: a remote path, or a local one inside ``dirpath`` that is not the
    checkpoint this run resumed from (``ModelCheckpoint``'s rule for its own deletions).

    Args:
        path: A checkpoint this callback saved.
        dirpath: The callback's folder.
        resume_path: ``trainer.ckpt_path`` (``None`` without a resume).

    Returns:
        True when the file may be deleted.
    """
    if not is_local_path(path):
        return True
    absolute = Path(path).absolute()
    if resume_path is not None and is_local_path(resume_path) and absolute == Path(resume_path).absolute():
        return False
    return dirpath is not None and Path(dirpath).absolute() in absolute.parents
