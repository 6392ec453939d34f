"""The ``sampling: batch_rebalance`` training sampler: per optimizer step, micro-batches balanced across ranks.

A :class:`~lit_trainer.data.samplers.BatchSampler` (rank-aware, the order a pure function of ``(seed, epoch)``,
``set_epoch``, ``state_dict``/``load_state_dict`` with ``{"epoch", "position"}``, the same ``len()`` on every rank)
that differs from the HF Trainer's reference sampler where the reference has a bug (no global RNG, no duplicated
samples in the tail, no replay of epoch 0 on a multi-rank resume) and in how one optimizer step is split: exactly
optimal for one micro-batch per rank, a dynamic program instead of hill climbing for several (see
:func:`~lit_trainer.data.samplers.rebalance.balance_step`).

Cost model of one micro-batch (as the reference): ``cost = bs * max_len + 0.001 * bs * max_len**2``, the padded
tokens plus an attention term. Internally costs are exact integers, ``1000 * cost = bs * max_len * (1000 + max_len)``,
so every rank computes bit-identical partitions. Padding-free packed micro-batches (``cost_model="packed"``) cost
their total token count instead (:func:`~lit_trainer.data.samplers.rebalance.balance_packed_step`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lit_trainer.data.samplers.batch_sampler import EpochPosition, resolve_replicas
from lit_trainer.data.samplers.lengths import check_lengths
from lit_trainer.data.samplers.rebalance import COST_MODELS, CostModel, balance_packed_step, balance_step


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
            token count, split by :func:`~lit_trainer.data.samplers.rebalance.balance_packed_step`).

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
        self.lengths = check_lengths(lengths, "BatchRebalanceSampler")
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
