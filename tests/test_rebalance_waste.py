"""``batch_rebalance`` breaks straggler-cost ties by padding waste: no more waste than the transformers reference
(within 5%) at a straggler cost no higher, on the long-tailed setting where it used to pad more."""

from __future__ import annotations

import random

from transformers.trainer_pt_utils import BatchRebalanceSampler as ReferenceRebalance

from lit_trainer.data.samplers.rebalance import balance_step, microbatch_cost


def _waste_and_straggler(lengths: list[int], plan: list[list[list[int]]]) -> tuple[int, float]:
    """Padded minus real tokens, and the sum over slots of the slowest rank's micro-batch cost."""
    waste, straggler = 0, 0.0
    for slot in range(len(plan[0])):
        costs = []
        for per_rank in plan:
            rows = [lengths[i] for i in per_rank[slot]]
            waste += len(rows) * max(rows) - sum(rows)
            costs.append(microbatch_cost(len(rows), max(rows)))
        straggler += max(costs)
    return waste, straggler


def _reference_plan(lengths: list[int], world: int, slots: int) -> list[list[list[int]]]:
    """The reference's split of exactly these samples (one step), through its public iterator, rank by rank."""
    return [list(ReferenceRebalance(lengths, len(lengths), world, slots, shuffle=False, rank=r)) for r in range(world)]


def test_long_tailed_steps_pad_no_more_than_the_reference_at_a_lower_straggler_cost():
    rng = random.Random(0)
    world, slots = 8, 4
    ours, reference = [0, 0.0], [0, 0.0]
    for _ in range(24):  # 24 optimizer steps of 8 ranks x 4 micro-batches x 8 samples, log-normal lengths
        lengths = [min(4096, max(8, int(rng.lognormvariate(5.5, 0.8)))) for _ in range(world * slots * 8)]
        for total, plan in (
            (ours, balance_step(lengths, world, slots)),
            (reference, _reference_plan(lengths, world, slots)),
        ):
            waste, straggler = _waste_and_straggler(lengths, plan)
            total[0] += waste
            total[1] += straggler
    assert ours[1] <= reference[1]
    assert ours[0] <= 1.05 * reference[0], f"padding waste {ours[0] / reference[0] - 1:+.1%} vs the reference"
