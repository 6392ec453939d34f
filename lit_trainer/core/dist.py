"""Small collectives shared by the callbacks and modules that write per-rank state into a checkpoint."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

T = TypeVar("T")


def gather_from_all_ranks(local: T) -> list[T]:
    """Every rank's object, in rank order (a collective under an initialised process group of size > 1).

    Lightning writes a checkpoint from rank 0 only, so state that differs per rank (RNG states, GRPO rollout buffers,
    accumulated gradients) is gathered first; call it on every rank, as ``trainer.save_checkpoint`` is.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def gather_to_rank_zero(local: T) -> list[T] | None:
    """Every rank's object in rank order on rank 0 (``None`` on the other ranks, which do not write checkpoints)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return gathered
