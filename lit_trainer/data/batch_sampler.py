"""Rank-aware, epoch-seeded batch samplers for the training loader (``sampling: random | sequential``).

Every training batch sampler used by :class:`~lit_trainer.data.loader.TrainLoader` follows one small protocol:

* iterating yields THIS rank's micro-batches (lists of dataset indices) for the current epoch;
* ``len()`` is the number of micro-batches this rank yields per epoch, equal on every rank (so DDP never hangs);
* ``set_epoch(e)`` selects the epoch; the order is a pure function of ``(seed, epoch, rank)``, never of a global RNG,
  so a resumed run sees exactly the same order;
* ``state_dict()``/``load_state_dict()`` hold ``{"epoch", "position"}``.

The length-aware strategies (``group_by_length``, ``batch_rebalance``) live in :mod:`lit_trainer.data.samplers`;
:func:`make_batch_sampler` dispatches on the ``sampling`` option.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch

from lit_trainer.data.rebalance import CostModel

Sampling = Literal["random", "sequential", "group_by_length", "batch_rebalance"]
SAMPLING_CHOICES: tuple[str, ...] = ("random", "sequential", "group_by_length", "batch_rebalance")


class EpochPosition:
    """Shared ``set_epoch``/``state_dict``/``load_state_dict`` of the samplers: ``{"epoch", "position"}``.

    ``position`` counts the items (indices or micro-batches) already yielded in the current epoch; a loaded position
    is consumed by the next iteration of that epoch, which then starts at it.
    """

    epoch: int = 0
    position: int = 0
    _resume_at: int = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields."""
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the items already yielded in this epoch."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration yields epoch ``state["epoch"]`` from item ``state["position"]``."""
        self.epoch = int(state["epoch"])
        self._resume_at = int(state["position"])


class ShardedBatchSampler(EpochPosition):
    """Shuffled (or sequential) micro-batches, dealt round-robin to ranks.

    The epoch's index order is ``randperm(n)`` from a generator seeded with ``seed + epoch`` (or ``range(n)`` when
    ``shuffle=False``); it is cut into global batches of ``batch_size``, and batch ``j`` goes to rank
    ``j % num_replicas``. When the number of batches is not a multiple of ``num_replicas``, the last round is
    completed by re-using the first indices of the epoch (like ``DistributedSampler``) unless ``drop_last=True``, so
    every rank yields the same number of micro-batches.

    Args:
        num_samples: dataset size.
        batch_size: micro-batch size per rank.
        shuffle: shuffle with ``seed + epoch``.
        seed: base seed.
        num_replicas: world size (default: the initialised process group, else 1).
        rank: this rank (default: the initialised process group, else 0).
        drop_last: drop the incomplete last batch and the incomplete last round of batches.

    Raises:
        ValueError: on an empty dataset, ``batch_size < 1`` or a rank outside ``[0, num_replicas)``.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        num_replicas, rank = resolve_replicas(num_replicas, rank)
        if num_samples < 1:
            raise ValueError("The training dataset is empty: there is nothing to sample. Check the data source.")
        if batch_size < 1:
            raise ValueError(f"`batch_size={batch_size}` is invalid: it must be >= 1.")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._resume_at = 0

    def _global_batches(self) -> list[list[int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and len(batches[-1]) < self.batch_size:
            batches.pop()
        rounds, leftover = divmod(len(batches), self.num_replicas)
        if leftover and self.drop_last:
            return batches[: rounds * self.num_replicas]
        if leftover:
            # complete the last round with the first indices of the epoch (wrapping as often as needed)
            need = self.num_replicas - leftover
            flat = [i for batch in batches[:need] for i in batch] or order
            reps = math.ceil(need * self.batch_size / len(flat))
            pool = (flat * reps)[: need * self.batch_size]
            batches += [pool[k * self.batch_size : (k + 1) * self.batch_size] for k in range(need)]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        mine = self._global_batches()[self.rank :: self.num_replicas]
        start, self._resume_at = self._resume_at, 0
        self.position = start
        for self.position, batch in enumerate(mine[start:], start=start + 1):
            yield batch
        self.position = 0

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        batches = full + (1 if rest and not self.drop_last else 0)
        return batches // self.num_replicas if self.drop_last else math.ceil(batches / self.num_replicas)


def resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Default ``num_replicas``/``rank`` to the initialised process group (1 and 0 without one) and validate them."""
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if num_replicas is None:
        num_replicas = torch.distributed.get_world_size() if initialised else 1
    if rank is None:
        rank = torch.distributed.get_rank() if initialised else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(
            f"`num_replicas={num_replicas}, rank={rank}` is invalid: need num_replicas >= 1 and 0 <= rank < num_replicas."
        )
    return num_replicas, rank


def _random(lengths: Callable[[], Sequence[int]], num_samples: int, **kw: Any) -> ShardedBatchSampler:
    return ShardedBatchSampler(num_samples, kw["batch_size"], shuffle=True, seed=kw["seed"],
                               num_replicas=kw["num_replicas"], rank=kw["rank"], drop_last=kw["drop_last"])


def _sequential(lengths: Callable[[], Sequence[int]], num_samples: int, **kw: Any) -> ShardedBatchSampler:
    return ShardedBatchSampler(num_samples, kw["batch_size"], shuffle=False, seed=kw["seed"],
                               num_replicas=kw["num_replicas"], rank=kw["rank"], drop_last=kw["drop_last"])


def _group_by_length(lengths: Callable[[], Sequence[int]], num_samples: int, **kw: Any) -> Any:
    from lit_trainer.data.samplers import make_length_grouped_batch_sampler

    return make_length_grouped_batch_sampler(lengths(), **kw)


def _batch_rebalance(lengths: Callable[[], Sequence[int]], num_samples: int, **kw: Any) -> Any:
    from lit_trainer.data.samplers import BatchRebalanceSampler

    return BatchRebalanceSampler(
        lengths(), kw["batch_size"], num_replicas=kw["num_replicas"], rank=kw["rank"],
        accumulate_grad_batches=kw["accumulate_grad_batches"], seed=kw["seed"], drop_last=kw["drop_last"],
        cost_model=kw["cost_model"],
    )


_FACTORIES: dict[str, Callable[..., Any]] = {
    "random": _random,
    "sequential": _sequential,
    "group_by_length": _group_by_length,
    "batch_rebalance": _batch_rebalance,
}


def make_batch_sampler(
    sampling: Sampling,
    *,
    num_samples: int,
    lengths: Callable[[], Sequence[int]],
    batch_size: int,
    seed: int,
    num_replicas: int,
    rank: int,
    accumulate_grad_batches: int = 1,
    drop_last: bool = False,
    cost_model: CostModel = "padded",
) -> Any:
    """Build the training batch sampler for ``sampling`` (see the module docstring for the protocol).

    Args:
        sampling: one of ``random``, ``sequential``, ``group_by_length``, ``batch_rebalance``.
        num_samples: dataset size.
        lengths: a zero-argument callable returning per-sample lengths (only called by length-aware strategies, so
            datasets without lengths work with random/sequential).
        batch_size: micro-batch size per rank (the average size for ``batch_rebalance``).
        seed: base seed; epoch ``e`` uses ``seed + e``.
        num_replicas: world size.
        rank: this rank.
        accumulate_grad_batches: micro-batches per optimizer step (``batch_rebalance`` balances per step).
        drop_last: drop incomplete batches instead of completing them.
        cost_model: ``batch_rebalance``'s micro-batch cost, ``"padded"`` or ``"packed"`` (padding-free rows; see
            :mod:`lit_trainer.data.rebalance`).

    Raises:
        ValueError: for an unknown ``sampling``.
    """
    if sampling not in _FACTORIES:
        raise ValueError(f"`sampling={sampling!r}` is invalid: choose one of {SAMPLING_CHOICES}.")
    return _FACTORIES[sampling](
        lengths, num_samples, batch_size=batch_size, seed=seed, num_replicas=num_replicas, rank=rank,
        accumulate_grad_batches=accumulate_grad_batches, drop_last=drop_last, cost_model=cost_model,
    )
