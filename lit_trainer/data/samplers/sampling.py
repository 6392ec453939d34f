"""The ``sampling`` option of the data modules: one table from name to batch-sampler factory.

``Sampling`` is the option's type (the CLI and the data modules validate against it) and :data:`SAMPLERS` maps each
of its values to a factory returning a :class:`~lit_trainer.data.samplers.BatchSampler`; an import-time check
keeps the two equal, so adding a strategy is one entry here plus its name in ``Sampling`` (``docs/resume.md``,
"Adding a sampler").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, get_args

from lit_trainer.data.samplers.batch_sampler import BatchSampler, ShardedBatchSampler
from lit_trainer.data.samplers.length_grouped import make_length_grouped_batch_sampler
from lit_trainer.data.samplers.rebalance import CostModel
from lit_trainer.data.samplers.rebalance_sampler import BatchRebalanceSampler

Sampling = Literal["random", "sequential", "group_by_length", "batch_rebalance"]


class SamplerRequest(NamedTuple):
    """Everything a sampler factory may use (each factory takes what it needs)."""

    num_samples: int
    lengths: Callable[[], Sequence[int]]  # only called by length-aware strategies
    batch_size: int
    seed: int
    num_replicas: int
    rank: int
    accumulate_grad_batches: int
    drop_last: bool
    cost_model: CostModel


SamplerFactory = Callable[[SamplerRequest], BatchSampler]


def _placement(r: SamplerRequest) -> dict[str, int | bool]:
    """The arguments every sampler takes alike: seed, ranks and the incomplete-batch rule."""
    return {"seed": r.seed, "num_replicas": r.num_replicas, "rank": r.rank, "drop_last": r.drop_last}


def _sharded(shuffle: bool) -> SamplerFactory:
    def build(r: SamplerRequest) -> BatchSampler:
        return ShardedBatchSampler(r.num_samples, r.batch_size, shuffle=shuffle, **_placement(r))

    return build


SAMPLERS: dict[str, SamplerFactory] = {
    "random": _sharded(shuffle=True),
    "sequential": _sharded(shuffle=False),
    "group_by_length": lambda r: make_length_grouped_batch_sampler(
        r.lengths(), batch_size=r.batch_size, accumulate_grad_batches=r.accumulate_grad_batches, **_placement(r)
    ),
    "batch_rebalance": lambda r: BatchRebalanceSampler(
        r.lengths(),
        r.batch_size,
        accumulate_grad_batches=r.accumulate_grad_batches,
        cost_model=r.cost_model,
        **_placement(r),
    ),
}
if set(SAMPLERS) != set(get_args(Sampling)):  # one table: a strategy missing from either side fails at import
    raise RuntimeError(f"SAMPLERS {tuple(SAMPLERS)} and Sampling {get_args(Sampling)} disagree: edit both together.")


def check_sampling(sampling: str, owner: str = "sampling") -> None:
    """Raise a ValueError naming the choices when ``sampling`` is not a ``Sampling`` value."""
    if sampling not in SAMPLERS:
        raise ValueError(f"`{owner}={sampling!r}` is invalid: choose one of {get_args(Sampling)}.")


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
) -> BatchSampler:
    """Build the training batch sampler registered for ``sampling`` in :data:`SAMPLERS`.

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
            :mod:`lit_trainer.data.samplers.rebalance`).

    Raises:
        ValueError: for an unknown ``sampling``.
    """
    check_sampling(sampling)
    return SAMPLERS[sampling](
        SamplerRequest(
            num_samples, lengths, batch_size, seed, num_replicas, rank, accumulate_grad_batches, drop_last, cost_model
        )
    )
