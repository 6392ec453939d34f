"""BEMA on sharded parameters (FSDP2 ``DTensor``): buffers per local shard, full tensors at the boundaries.

The BEMA update is elementwise, so each rank averages its own shard of each parameter (``DTensor.to_local()``): no
communication while training, and 1/W of the buffer memory per rank. Full tensors are needed where the weights
leave the rank: :meth:`BEMA.bema_state_dict`, the checkpoint state (Lightning's distributed checkpoint keeps the
callback states of global rank 0 only, so the state holds full tensors, and every rank cuts its shard out of them on
load), the scored weights ``BestCheckpoint`` stores and the Hugging Face export. Gathering is a collective: every rank
calls these functions in the same order. With plain tensors (one device, DDP) every function is the identity.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_trainer.core.sharding import is_dtensor, local, shard_like


def locals_of(params: list[Tensor]) -> list[Tensor]:
    """The local shards of ``params`` (views sharing the parameters' memory), the tensors themselves when plain."""
    return [local(p) for p in params]


def as_param_layout(buffer: Tensor, param: Tensor) -> Tensor:
    """``buffer`` (a local shard of ``param``'s shape) as a ``DTensor`` sharded like ``param``; plain: unchanged."""
    if not is_dtensor(param):
        return buffer
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        buffer.to(param.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


@torch.no_grad()
def gather(buffers: list[Tensor], params: list[Tensor]) -> list[Tensor]:
    """The full tensors of local-shard ``buffers`` (a collective when sharded), on the buffers' devices."""
    return [as_param_layout(b, p).full_tensor().to(b.device) if is_dtensor(p) else b for b, p in zip(buffers, params)]


def local_shard_like(full: Tensor, param: Tensor) -> Tensor:
    """This rank's shard of the full tensor ``full``, cut as ``param`` is (no communication); plain: ``full``."""
    return local(shard_like(full, param))


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are split the same way (both plain, or DTensors on one mesh with one placement)."""
    if is_dtensor(a) != is_dtensor(b):
        return False
    return not is_dtensor(a) or (a.device_mesh == b.device_mesh and a.placements == b.placements)
