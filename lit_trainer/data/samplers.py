"""Length-aware training samplers: ``sampling: group_by_length`` and ``sampling: batch_rebalance``.

Both are :class:`~lit_trainer.data.batch_sampler.BatchSampler` s (rank-aware, the order a pure
function of ``(seed, epoch)``, ``set_epoch``, ``state_dict``/``load_state_dict`` with ``{"epoch", "position"}``, the
same ``len()`` on every rank) and differ from the HF Trainer's reference samplers where the
reference has a bug (no global RNG, no duplicated samples in the tail, no replay of epoch 0 on a multi-rank resume)
and in how one optimizer step is split: exactly optimal for one micro-batch per rank, a dynamic program instead of
hill climbing for several (see :func:`balance_step`).

Cost model of one micro-batch (as the reference): ``cost = bs * max_len + 0.001 * bs * max_len**2``, the padded
tokens plus an attention term. Internally costs are exact integers, ``1000 * cost = bs * max_len * (1000 + max_len)``,
so every rank computes bit-identical partitions. Padding-free packed micro-batches (``cost_model="packed"``) cost
their total token count instead (:func:`~lit_trainer.data.rebalance.balance_packed_step`).

The module also holds :func:`require_lengths` (lengths for the data modules, with errors that name the fix) and the
pure diagnostics :func:`padding_stats` / :func:`cost_spread` that the training module logs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from lit_trainer.data.batch_sampler import EpochPosition, ShardedBatchSampler, resolve_replicas
from lit_trainer.data.rebalance import COST_MODELS, QUADRATIC_COST_COEF, CostModel, balance_packed_step, balance_step

_MEGA_BATCH_STEPS = 50  # group_by_length: at most this many optimizer steps per mega-batch (the reference's 50)


def _check_lengths(lengths: Any, owner: str) -> list[int]:
    """Lengths as a list of non-negative ints, or a ValueError that names the fix."""
    fix = (
        "give one non-negative int per row (the data modules read the `length` column named by "
        "`length_column_name`, computed once at preprocessing), or use `sampling: random`."
    )
    if lengths is None:
        raise ValueError(f"`{owner}(lengths=None)` is invalid: {fix}")
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    out = list(lengths)
    for i, length in enumerate(out):
        if length is None or isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ValueError(f"`{owner}` got length {length!r} for row {i}: {fix}")
    if not out:
        raise ValueError(f"`{owner}` got no lengths: the training dataset is empty. Check the data source.")
    return [int(length) for length in out]


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
        self.lengths = _check_lengths(lengths, "LengthGroupedSampler")
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
    """The ``group_by_length`` training batch sampler (a :class:`~lit_trainer.data.batch_sampler.BatchSampler`).

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
    lengths = _check_lengths(lengths, "group_by_length")
    step_batches = accumulate_grad_batches * num_replicas
    mult = max(1, min(len(lengths) // (4 * batch_size), _MEGA_BATCH_STEPS * step_batches))
    index_sampler = LengthGroupedSampler(lengths, batch_size, seed=seed, mega_batch_mult=mult)
    return LengthGroupedBatchSampler(
        index_sampler, batch_size, num_replicas=num_replicas, rank=rank, drop_last=drop_last
    )


class BatchRebalanceSampler(EpochPosition):
    """Per optimizer step, micro-batches whose padded-token cost is balanced across ranks (``batch_rebalance``).

    Epoch ``e``: ``randperm(n)`` seeded with ``seed + e`` is cut into steps of ``batch_size * accumulate_grad_batches
    * num_replicas`` samples; each step is split by :func:`balance_step` into ``accumulate_grad_batches`` micro-batches
    per rank (contiguous groups of the step's samples sorted by length; every slot's ``num_replicas`` micro-batches
    cost about the same, so no rank waits at a gradient sync). ``batch_size`` is the AVERAGE micro-batch size:
    micro-batches of long samples are smaller. Every rank computes the same split (integer arithmetic, no
    communication) and yields its own micro-batches, slot by slot.

    Tail (``n`` not a multiple of the step size ``S``), unlike the reference no sample is duplicated:

    * ``drop_last=True``: the last ``n % S`` samples of the epoch's order are dropped;
    * ``drop_last=False`` and ``n % S >= num_replicas``: a last, shorter step of ``min(accumulate_grad_batches,
      (n % S) // num_replicas)`` micro-batches per rank (Lightning steps the optimizer after it, token-exact);
    * ``drop_last=False`` and ``0 < n % S < num_replicas``: those samples join the previous step (which then has a
      few more than ``S``), since they cannot give every rank a non-empty micro-batch.

    So every sample is used exactly once per epoch unless ``drop_last``, no micro-batch is empty, and every rank
    yields ``len(self)`` micro-batches. Use it through our data modules (``sampling: batch_rebalance``), whose
    loader Lightning neither wraps nor re-shuffles.

    Args:
        lengths: one length per dataset row (e.g. the ``length`` column).
        batch_size: average micro-batch size per rank.
        num_replicas: world size (default: the initialised process group, else 1).
        rank: this rank (default: the initialised process group, else 0).
        accumulate_grad_batches: micro-batches per rank per optimizer step.
        seed: base seed; epoch ``e`` uses ``seed + e``.
        drop_last: drop the incomplete last step instead of training on it.
        cost_model: ``"padded"`` (default: right-padded micro-batches, and ``packing="bfd"`` bins with their bin
            lengths) or ``"packed"`` (``packing="padding_free"``: a micro-batch is one flattened row costing its total
            token count, split by :func:`~lit_trainer.data.rebalance.balance_packed_step`).

    Raises:
        ValueError: on an unknown ``cost_model``, missing/negative lengths, ``batch_size < 1``,
            ``accumulate_grad_batches < 1``, a bad rank,
            fewer samples than ranks, or ``drop_last=True`` with fewer samples than one step.

    Example:
        >>> sampler = BatchRebalanceSampler([466, 36, 414, 56, 30, 300], 1, num_replicas=2, rank=0)
        >>> len(sampler), sum(len(mb) for mb in sampler)  # 3 samples per step on 2 ranks: [2 steps], 1 slot each
        (3, 3)
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        accumulate_grad_batches: int = 1,
        seed: int = 0,
        drop_last: bool = False,
        cost_model: CostModel = "padded",
    ) -> None:
        if cost_model not in COST_MODELS:
            raise ValueError(
                f"`BatchRebalanceSampler(cost_model={cost_model!r})` is invalid: choose one of "
                f"{COST_MODELS} ('packed' for padding-free micro-batches)."
            )
        self.cost_model = cost_model
        self.lengths = _check_lengths(lengths, "BatchRebalanceSampler")
        if batch_size < 1:
            raise ValueError(f"`BatchRebalanceSampler(batch_size={batch_size})` is invalid: batch_size must be >= 1.")
        if accumulate_grad_batches < 1:
            raise ValueError(
                f"`BatchRebalanceSampler(accumulate_grad_batches={accumulate_grad_batches})` is invalid: "
                "it must be >= 1."
            )
        self.num_replicas, self.rank = resolve_replicas(num_replicas, rank)
        self.batch_size = batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.seed = seed
        self.drop_last = drop_last
        self.steps = _plan_steps(
            len(self.lengths),
            batch_size * accumulate_grad_batches * self.num_replicas,
            self.num_replicas,
            accumulate_grad_batches,
            drop_last,
        )
        self._cached: tuple[int | None, list[int]] = (None, [])

    def step_plan(self, epoch: int, step: int) -> list[list[list[int]]]:
        """``plan[rank][slot]``: dataset indices of every rank's micro-batches in ``step`` of ``epoch``."""
        start, end, slots = self.steps[step]
        order = self._order(epoch)[start:end]
        balance = balance_packed_step if self.cost_model == "packed" else balance_step
        plan = balance([self.lengths[i] for i in order], self.num_replicas, slots)
        return [[[order[p] for p in mb] for mb in per_rank] for per_rank in plan]

    def _order(self, epoch: int) -> list[int]:
        if self._cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._cached = (epoch, torch.randperm(len(self.lengths), generator=generator).tolist())
        return self._cached[1]

    def _iter_from(self, start: int) -> Iterator[list[int]]:
        first = _step_at(self.steps, start)  # the steps before the resume point are not even planned
        done = sum(slots for _, _, slots in self.steps[:first])
        for step in range(first, len(self.steps)):
            for micro_batch in self.step_plan(self.epoch, step)[self.rank]:
                done += 1
                if done > start:
                    yield micro_batch

    def __len__(self) -> int:
        return sum(slots for _, _, slots in self.steps)


def _plan_steps(n: int, step_size: int, replicas: int, slots: int, drop_last: bool) -> list[tuple[int, int, int]]:
    """``(start, end, micro-batches per rank)`` of every step of an epoch (see :class:`BatchRebalanceSampler`)."""
    full, rest = divmod(n, step_size)
    steps = [(s * step_size, (s + 1) * step_size, slots) for s in range(full)]
    if drop_last and not steps:
        raise ValueError(
            f"`drop_last=True` would drop every sample: the dataset has {n} rows but one optimizer step "
            f"takes batch_size x accumulate_grad_batches x num_replicas = {step_size}. Lower batch_size "
            "or accumulate_grad_batches, or set drop_last=False."
        )
    if rest and not drop_last:
        if rest >= replicas:
            steps.append((full * step_size, n, min(slots, rest // replicas)))
        elif steps:
            steps[-1] = (steps[-1][0], n, slots)  # too few to give every rank a micro-batch: join the last step
        else:
            raise ValueError(
                f"The dataset has {n} rows but there are {replicas} ranks: every rank needs at least one "
                "sample per step. Use more data or fewer devices."
            )
    return steps


def _step_at(steps: Sequence[tuple[int, int, int]], position: int) -> int:
    """Index of the step that holds micro-batch ``position`` of a rank (``len(steps)`` past the end)."""
    done = 0
    for step, (_, _, slots) in enumerate(steps):
        if position < done + slots:
            return step
        done += slots
    return len(steps)


# ---------------------------------------------------------------------------------------------------------------
# Lengths for the data modules, and per-step diagnostics for the training module
# ---------------------------------------------------------------------------------------------------------------


def require_lengths(
    dataset: Any, length_column_name: str = "length", *, sampling: str = "batch_rebalance"
) -> list[int]:
    """The per-row lengths a length-aware ``sampling`` needs, from the dataset's ``length_column_name`` column.

    Never recomputes lengths by reading rows (that would be a second pass over the data at fit time).

    Args:
        dataset: a map-style ``datasets.Dataset`` (or any object with ``column_names`` and column access).
        length_column_name: the column holding one token count per row.
        sampling: the strategy that asked (named in error messages).

    Returns:
        The lengths as a list of ints.

    Raises:
        ValueError: for an iterable (streaming) dataset, a dataset without the column, or missing/negative values.

    Example:
        >>> import datasets
        >>> require_lengths(datasets.Dataset.from_dict({"length": [3, 5]}), "length")
        [3, 5]
    """
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"`sampling: {sampling}` needs a map-style dataset with per-row lengths, but the training "
            f"dataset is iterable ({type(dataset).__name__}): there is no epoch order to rearrange. Use "
            "`sampling: random` (or `sequential`), or load the data as a map-style `datasets.Dataset`."
        )
    columns = getattr(dataset, "column_names", None)
    if columns is None or length_column_name not in columns:
        raise ValueError(
            f"`sampling: {sampling}` needs per-row lengths, but the training dataset has no column "
            f"`length_column_name={length_column_name!r}` (columns: {columns}). Add it at preprocessing, "
            f"e.g. `dataset.map(lambda row: {{{length_column_name!r}: len(row['input_ids'])}})`, point "
            "`length_column_name` at an existing length column, or use `sampling: random`."
        )
    column = (
        dataset.select_columns([length_column_name]).with_format("arrow")[:]
        if hasattr(dataset, "select_columns")
        else None
    )
    values = column.column(length_column_name).to_pylist() if column is not None else list(dataset[length_column_name])
    try:
        return _check_lengths(values, f"sampling: {sampling}")
    except ValueError as err:
        raise ValueError(f"{err} (column `length_column_name={length_column_name!r}`)") from None


def padding_stats(lengths: torch.Tensor, padded_length: int | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Padding diagnostics of one micro-batch, as tensors (no host sync): log them, all-gather ``cost`` under DDP.

    Args:
        lengths: ``(B,)`` real tokens per row, e.g. ``attention_mask.sum(-1)``.
        padded_length: the batch's padded width (``input_ids.shape[1]``); default ``lengths.max()``.

    Returns:
        ``tokens`` (real tokens), ``padded_tokens`` (``B * width``), ``padding_fraction`` (``1 - tokens /
        padded_tokens``) and ``cost`` (the samplers' cost model, ``B * width + 0.001 * B * width**2``), float32.

    Example:
        >>> stats = padding_stats(torch.tensor([4, 2, 2]))  # 3 rows padded to 4: 12 slots, 8 real tokens
        >>> [round(float(stats[k]), 4) for k in ("tokens", "padded_tokens", "padding_fraction", "cost")]
        [8.0, 12.0, 0.3333, 12.048]
    """
    lengths = lengths.reshape(-1).to(torch.float32)
    width = (
        lengths.max()
        if padded_length is None
        else torch.as_tensor(padded_length, dtype=torch.float32, device=lengths.device)
    )
    rows = lengths.numel()
    tokens, padded = lengths.sum(), rows * width
    return {
        "tokens": tokens,
        "padded_tokens": padded,
        "padding_fraction": 1 - tokens / padded.clamp_min(1),
        "cost": padded + QUADRATIC_COST_COEF * rows * width * width,
    }


def cost_spread(costs: torch.Tensor) -> torch.Tensor:
    """Relative spread ``(max - min) / max`` of the ranks' micro-batch costs (0 = balanced; 0.5 = half idle).

    Args:
        costs: ``(W,)`` one ``padding_stats(...)["cost"]`` per rank, e.g. ``LightningModule.all_gather(cost)``.

    Example:
        >>> round(float(cost_spread(torch.tensor([100.0, 80.0]))), 6)
        0.2
    """
    top = costs.max()
    return (top - costs.min()) / top.clamp_min(torch.finfo(costs.dtype).tiny)
