"""The ``sampling: group_by_length`` training samplers: indices in mega-batches sorted by length.

:class:`LengthGroupedSampler` is the index order, :class:`LengthGroupedBatchSampler` (built by
:func:`make_length_grouped_batch_sampler`) the :class:`~lit_trainer.data.samplers.BatchSampler` the data modules
use (rank-aware, the order a pure function of ``(seed, epoch)``, ``set_epoch``, ``state_dict``/``load_state_dict``
with ``{"epoch", "position"}``, the same ``len()`` on every rank). They differ from the HF Trainer's reference sampler
where the reference has a bug (a private RNG instead of the global one, the mega-batch that gave up its longest sample
sorted again) and size mega-batches in optimizer steps across ranks.
The ``batch_rebalance`` sampler is :class:`~lit_trainer.data.samplers.rebalance_sampler.BatchRebalanceSampler`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lit_trainer.data.samplers.batch_sampler import EpochPosition, ShardedBatchSampler, resolve_replicas
from lit_trainer.data.samplers.lengths import check_lengths

_MEGA_BATCH_STEPS = 50  # group_by_length: at most this many optimizer steps per mega-batch (the reference's 50)


class LengthGroupedSampler(EpochPosition, torch.utils.data.Sampler[int]):
    """Dataset indices in mega-batches sorted by length, the longest sample first (``sampling: group_by_length``).

    Epoch ``e``: ``randperm(n)`` from a private generator seeded with ``seed + e`` (the reference draws from the
    global RNG, so a resumed run saw another order) is cut into mega-batches of ``mega_batch_mult * batch_size``
    indices; each is sorted by length, descending (stable); the overall longest sample is swapped to the front of
    mega-batch 0 so that an out-of-memory shows up at the first step. Unlike the reference, the mega-batch that
    gave up its longest sample is sorted again afterwards (the reference leaves the swapped-in sample unsorted at
    its head, adding padding to that batch).

    Args:
        lengths: one length per dataset row.
        batch_size: the unit of a mega-batch (the reference passes ``per_device_batch_size * accumulation``).
        seed: base seed; epoch ``e`` uses ``seed + e``.
        mega_batch_mult: batches per mega-batch; default ``min(n // (4 * batch_size), 50)``, at least 1 (reference).

    Raises:
        ValueError: on missing/negative lengths, ``batch_size < 1`` or ``mega_batch_mult < 1``.

    Example:
        >>> sampler = LengthGroupedSampler([3, 9, 1, 7], batch_size=2, seed=0)
        >>> sorted(sampler) == [0, 1, 2, 3] and next(iter(sampler)) == 1  # every index once, longest first
        True
    """

    def __init__(
        self, lengths: Sequence[int], batch_size: int, *, seed: int = 0, mega_batch_mult: int | None = None
    ) -> None:
        self.lengths = check_lengths(lengths, "LengthGroupedSampler")
        if batch_size < 1:
            raise ValueError(f"`LengthGroupedSampler(batch_size={batch_size})` is invalid: batch_size must be >= 1.")
        if mega_batch_mult is not None and mega_batch_mult < 1:
            raise ValueError(
                f"`LengthGroupedSampler(mega_batch_mult={mega_batch_mult})` is invalid: it must be >= 1 "
                "(or None for the reference default)."
            )
        n = len(self.lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.mega_batch_mult = mega_batch_mult or max(1, min(n // (4 * batch_size), _MEGA_BATCH_STEPS))

    def epoch_order(self, epoch: int) -> list[int]:
        """The full index order of ``epoch`` (a pure function of ``seed + epoch``)."""
        n, size, lengths = len(self.lengths), self.mega_batch_mult * self.batch_size, self.lengths
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        megas = [sorted(perm[i : i + size], key=lambda k: -lengths[k]) for i in range(0, n, size)]
        donor = max(range(len(megas)), key=lambda j: (lengths[megas[j][0]], -j))  # first mega-batch on ties
        if donor:
            megas[0][0], megas[donor][0] = megas[donor][0], megas[0][0]
            megas[donor].sort(key=lambda k: -lengths[k])
        return [i for mega in megas for i in mega]

    def _iter_from(self, start: int) -> Iterator[int]:
        return iter(self.epoch_order(self.epoch)[start:])

    def __len__(self) -> int:
        return len(self.lengths)


class LengthGroupedBatchSampler(ShardedBatchSampler):
    """:class:`LengthGroupedSampler` order cut into micro-batches and dealt round-robin to ranks.

    Micro-batch ``j`` of the epoch goes to rank ``j % num_replicas`` (accelerate's ``BatchSamplerShard``, as the
    reference); an incomplete last round is completed or dropped exactly as :class:`ShardedBatchSampler` does, so every
    rank yields the same number of micro-batches. Built by :func:`make_length_grouped_batch_sampler`.
    """

    def __init__(
        self,
        index_sampler: LengthGroupedSampler,
        batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            len(index_sampler),
            batch_size,
            shuffle=False,
            seed=index_sampler.seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=drop_last,
        )
        self.index_sampler = index_sampler

    def _global_batches(self) -> list[list[int]]:
        order = self.index_sampler.epoch_order(self.epoch)
        return [[order[p] for p in batch] for batch in super()._global_batches()]  # positions -> grouped order


def make_length_grouped_batch_sampler(
    lengths: Sequence[int],
    *,
    batch_size: int,
    seed: int,
    num_replicas: int | None = None,
    rank: int | None = None,
    accumulate_grad_batches: int = 1,
    drop_last: bool = False,
) -> LengthGroupedBatchSampler:
    """The ``group_by_length`` training batch sampler (a :class:`~lit_trainer.data.samplers.BatchSampler`).

    Mega-batch size: ``min(n // 4, 50 optimizer steps)`` rounded down to whole micro-batches, where an optimizer step
    is ``batch_size * accumulate_grad_batches * num_replicas`` samples. On one device this is the reference's size
    (``min(n // (4 * B * GA), 50) * B * GA``) or slightly larger; on ``W`` devices the reference keeps
    ``B * GA`` as the unit, so its mega-batches span only ``50 / W`` steps and leave more padding (the benchmark in
    ``benchmarks/sampling.py`` measures it). At least one micro-batch per mega-batch.

    Args:
        lengths: one length per dataset row.
        batch_size: micro-batch size per rank.
        seed: base seed (epoch ``e`` uses ``seed + e``).
        num_replicas: world size (default: the initialised process group, else 1).
        rank: this rank (default: the initialised process group, else 0).
        accumulate_grad_batches: micro-batches per optimizer step.
        drop_last: drop the incomplete last micro-batch and round instead of completing them.

    Raises:
        ValueError: on invalid lengths, sizes or ranks.
    """
    if accumulate_grad_batches < 1:
        raise ValueError(f"`accumulate_grad_batches={accumulate_grad_batches}` is invalid: it must be >= 1.")
    if batch_size < 1:
        raise ValueError(f"`batch_size={batch_size}` is invalid: it must be >= 1.")
    num_replicas, rank = resolve_replicas(num_replicas, rank)
    lengths = check_lengths(lengths, "group_by_length")
    step_batches = accumulate_grad_batches * num_replicas
    mult = max(1, min(len(lengths) // (4 * batch_size), _MEGA_BATCH_STEPS * step_batches))
    index_sampler = LengthGroupedSampler(lengths, batch_size, seed=seed, mega_batch_mult=mult)
    return LengthGroupedBatchSampler(
        index_sampler, batch_size, num_replicas=num_replicas, rank=rank, drop_last=drop_last
    )
