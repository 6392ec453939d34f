"""Gradient clipping by global norm, with the norm summed in float64 (``docs/sharding.md``, "Clipping").

Why not ``torch.nn.utils.clip_grad_norm_`` as it is: its float32 norm is summed in float32, and on the CPU one
tensor's norm is off by up to ~5e-6 relative (measured on a 12k-element embedding gradient), by an amount that depends
on how the tensor is split: FSDP2 sums each rank's shard and then the shards, DDP and one process the whole tensor.
The clip coefficient ``max_norm / norm`` then differs between the layouts by that much on every clipped step, which is
~50 times the rounding of the gradients themselves and was the largest part of the difference between a sharded and a
DDP GRPO run. Summing the squares in float64 (chunk by chunk: at most :data:`CHUNK` elements are copied to float64 at
a time) makes the norm, and so the coefficient, the same in every layout up to the gradients' own rounding.

The clipping itself is torch's: ``g <- g * min(1, max_norm / (norm + 1e-6))`` on every gradient, in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from lit_trainer.modules.base import _sharding

#: elements of one gradient converted to float64 at a time (128 MB of float64)
CHUNK = 1 << 24


def _sum_of_squares(tensor: Tensor) -> Tensor:
    """``sum(tensor ** 2)`` in float64, converting at most :data:`CHUNK` elements at a time."""
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for chunk in tensor.detach().reshape(-1).split(CHUNK):
        total += torch.linalg.vector_norm(chunk, dtype=torch.float64).square()  # one float64 pass per chunk
    return total


def _is_sharded(grad: Tensor) -> bool:
    """A DTensor whose local parts are disjoint pieces of it (FSDP2's ``Shard`` placement on a 1-D mesh)."""
    return _sharding.is_dtensor(grad) and grad.device_mesh.ndim == 1 and grad.placements[0].is_shard()


def total_norm(grads: list[Tensor]) -> Tensor:
    """The L2 norm of all ``grads`` together, summed in float64 (a float64 0-dim tensor on the gradients' device).

    Sharded (FSDP2) gradients: each rank sums the squares of its local shards and one all-reduce adds the ranks'
    sums (a collective every rank must join); plain and replicated gradients count once.
    """
    device = grads[0].device
    sharded = [g for g in grads if _is_sharded(g)]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in sharded:
        total += _sum_of_squares(grad.to_local()).to(device)
    if sharded:
        torch.distributed.all_reduce(total, group=sharded[0].device_mesh.get_group())
    for grad in grads:
        if not _is_sharded(grad):
            total += _sum_of_squares(_sharding.full(grad)).to(device)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """Scale the gradients of ``params`` in place so that their global norm is at most ``max_norm`` (``math.inf``:
    measure only) and return the pre-clipping norm as a float32 0-dim tensor (no host synchronisation).

    The coefficient is computed in float64 from :func:`total_norm`, then applied to each gradient (to the local
    shards of DTensor gradients) in its own dtype.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = total_norm(grads)
    if not math.isinf(max_norm):
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for grad in grads:
            shard = _sharding.local(grad)
            groups.setdefault((shard.device, shard.dtype), []).append(shard)
        for (device, dtype), tensors in groups.items():
            torch._foreach_mul_(tensors, coefficient.to(device, dtype))
    return norm.to(torch.float32)
