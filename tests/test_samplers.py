"""Unit tests of the length-aware samplers (``group_by_length``, ``batch_rebalance``) on hand-made length lists."""

from __future__ import annotations

import itertools
import random

import datasets
import pytest
import torch

from lit_trainer.data.samplers import LengthGroupedSampler
from lit_trainer.data.samplers.length_grouped import make_length_grouped_batch_sampler
from lit_trainer.data.samplers.lengths import cost_spread, padding_stats, require_lengths
from lit_trainer.data.samplers.rebalance import balance_step, microbatch_cost
from lit_trainer.data.samplers.rebalance_sampler import BatchRebalanceSampler

_rng = random.Random(0)
TOY = [_rng.randint(5, 500) for _ in range(64)]  # the 64 lengths of the reference's toy run


# ----------------------------------------------------------------------------------------------------------------
# independent helpers written for the tests
# ----------------------------------------------------------------------------------------------------------------


def mb_cost(lengths: list[int], micro_batch: list[int]) -> float:
    longest = max(lengths[i] for i in micro_batch)
    return len(micro_batch) * longest + 0.001 * len(micro_batch) * longest**2


def straggler(lengths: list[int], plan: list[list[list[int]]]) -> float:
    """Sum over slots of the max over ranks of the micro-batch cost."""
    slots = len(plan[0])
    return sum(max(mb_cost(lengths, plan[r][s]) for r in range(len(plan))) for s in range(slots))


def brute_force(lengths: list[int], replicas: int, slots: int) -> tuple[float, float]:
    """(min max group cost, min straggler) over ALL splits of the sorted lengths into contiguous groups."""
    ordered = sorted(lengths, reverse=True)
    m, k = len(ordered), replicas * slots
    best_max = best_sum = float("inf")
    for cuts in itertools.combinations(range(1, m), k - 1):
        bounds = (0, *cuts, m)
        costs = sorted((microbatch_cost(b - a, ordered[a]) for a, b in itertools.pairwise(bounds)), reverse=True)
        best_max = min(best_max, costs[0])
        # dealing groups to slots by descending cost is optimal for a sum of slot maxima
        best_sum = min(best_sum, sum(costs[::replicas]))
    return best_max, best_sum


def epoch_batches(lengths, batch_size, replicas, slots, *, epoch=0, seed=0, drop_last=False):
    """Every rank's micro-batches for one epoch."""
    out = []
    for rank in range(replicas):
        sampler = BatchRebalanceSampler(
            lengths,
            batch_size,
            num_replicas=replicas,
            rank=rank,
            accumulate_grad_batches=slots,
            seed=seed,
            drop_last=drop_last,
        )
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(out[-1]) == len(sampler)
    return out


# ----------------------------------------------------------------------------------------------------------------
# cost model and the split of one step
# ----------------------------------------------------------------------------------------------------------------


def test_cost_model_hand_checked():
    # reference toy step 0, rank 0 slot 0: 3 rows, longest 414 -> 3*414 + 0.001*3*414^2 = 1242 + 514.188
    assert microbatch_cost(3, 414) == pytest.approx(1756.188)
    # 7 rows, longest 166 -> 1162 + 0.001*7*27556 = 1162 + 192.892
    assert microbatch_cost(7, 166) == pytest.approx(1354.892)
    # two rows [466, 414] | [56, 36]: max(2*466 + 0.002*466^2, 2*56 + 0.002*56^2) = max(1366.312, 118.272)
    plan = balance_step([466, 36, 414, 56], num_replicas=2, num_slots=1)
    assert sorted(sorted(mb) for per_rank in plan for mb in per_rank) == [[0, 2], [1, 3]]
    assert straggler([466, 36, 414, 56], plan) == pytest.approx(1366.312)


def test_reference_toy_step_beats_reference():
    # step 0 of the reference toy run: the reference's hill climbing reaches a straggler of 1756.2 + 1354.9 = 3111.1
    # (transformers' BatchRebalanceSampler on TOY); the exact split must not be worse.
    lengths = [466, 437, 414, 317, 266, 263, 227, 212, 174, 166, 163, 160, 149, 133, 56, 36]
    plan = balance_step(lengths, num_replicas=2, num_slots=2)
    assert sorted(i for per_rank in plan for mb in per_rank for i in mb) == list(range(16))
    assert straggler(lengths, plan) <= 3111.1
    _, best = brute_force(lengths, 2, 2)
    assert straggler(lengths, plan) == pytest.approx(best)


def test_minimax_split_is_optimal_against_brute_force():
    rng = random.Random(1)
    for _ in range(120):
        replicas = rng.choice([2, 3, 4])
        m = rng.randint(replicas, 11)
        lengths = [max(1, int(rng.lognormvariate(5, 1))) for _ in range(m)]
        plan = balance_step(lengths, num_replicas=replicas, num_slots=1)
        best_max, _ = brute_force(lengths, replicas, 1)
        assert straggler(lengths, plan) == pytest.approx(best_max, rel=1e-12), lengths


def test_multi_slot_split_is_near_optimal_against_brute_force():
    rng = random.Random(2)
    gaps = []
    for _ in range(150):
        replicas, slots = rng.choice([(1, 2), (1, 3), (2, 2), (2, 3), (3, 2)])
        m = rng.randint(replicas * slots, 12)
        lengths = [max(1, int(rng.lognormvariate(5, 1))) for _ in range(m)]
        plan = balance_step(lengths, num_replicas=replicas, num_slots=slots)
        assert sorted(i for per_rank in plan for mb in per_rank for i in mb) == list(range(m))
        assert all(len(per_rank) == slots and all(per_rank) for per_rank in plan)
        ours, (_, best) = straggler(lengths, plan), brute_force(lengths, replicas, slots)
        assert ours >= best * (1 - 1e-12)
        gaps.append(ours / best - 1)
    # exact in most cases, about 0.3% above the optimum on average (slot blocks contiguous, 1% cap grid)
    assert sum(gap == pytest.approx(0, abs=1e-12) for gap in gaps) >= 0.8 * len(gaps)
    assert sum(gaps) / len(gaps) < 0.01


def test_balance_step_deals_slots_by_cost_and_rejects_too_few_samples():
    lengths = [900, 800, 100, 90, 80, 70, 60, 50]
    plan = balance_step(lengths, num_replicas=2, num_slots=2)
    slot_max = [max(mb_cost(lengths, plan[r][s]) for r in range(2)) for s in range(2)]
    assert slot_max[0] >= slot_max[1]  # the costliest slot first
    for per_rank in plan:
        for mb in per_rank:
            assert [lengths[i] for i in mb] == sorted((lengths[i] for i in mb), reverse=True)  # longest first
    with pytest.raises(ValueError, match="cannot fill 4 micro-batches"):
        balance_step([1, 2, 3], num_replicas=2, num_slots=2)


# ----------------------------------------------------------------------------------------------------------------
# BatchRebalanceSampler over epochs
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "batch_size", "replicas", "slots", "expected_len"),
    [
        (64, 4, 2, 2, 8),  # 4 full steps of 16: 4 * 2 micro-batches per rank
        (61, 4, 2, 2, 8),  # 3 full steps + tail of 13 >= 2 ranks: min(2, 13 // 2) = 2 slots
        (17, 2, 3, 2, 3),  # step of 12 + tail of 5 >= 3 ranks: min(2, 5 // 3) = 1 slot -> 2 + 1
        (5, 1, 2, 4, 2),  # n < W * GA = 8: one short step of min(4, 5 // 2) = 2 slots per rank
        (17, 2, 2, 2, 4),  # 2 steps of 8 + 1 leftover < 2 ranks: joins the last step -> still 2 * 2
        (9, 1, 4, 1, 2),  # step of 4, step of 4, 1 leftover joins the 2nd step
    ],
)
def test_every_index_once_disjoint_ranks_equal_counts(n, batch_size, replicas, slots, expected_len):
    lengths = TOY[:n]
    for epoch in (0, 1):
        per_rank = epoch_batches(lengths, batch_size, replicas, slots, epoch=epoch)
        assert [len(batches) for batches in per_rank] == [expected_len] * replicas
        assert all(batch for batches in per_rank for batch in batches)  # no empty micro-batch
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(seen) == list(range(n))  # every index exactly once, so ranks are disjoint


def test_steps_hold_consecutive_chunks_of_the_seeded_permutation():
    n, batch_size, replicas, slots, seed, epoch = 40, 2, 2, 3, 7, 3
    per_rank = epoch_batches(TOY[:n], batch_size, replicas, slots, epoch=epoch, seed=seed)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    # a step holds batch_size * slots * replicas = 12 rows: [0,12) [12,24) [24,36), then a tail of 4 rows that
    # gives min(slots, 4 // replicas) = 2 micro-batches per rank
    bounds = [(0, 12, 3), (12, 24, 3), (24, 36, 3), (36, 40, 2)]
    done = 0
    for start, end, micro in bounds:
        got = {i for batches in per_rank for batch in batches[done : done + micro] for i in batch}
        assert got == set(order[start:end])
        done += micro


def test_drop_last_drops_the_tail_only():
    n = 17  # step of 2 * 2 * 2 = 8: two full steps, 1 sample dropped
    per_rank = epoch_batches(TOY[:n], 2, 2, 2, drop_last=True)
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    assert seen == sorted(order[:16])
    assert [len(b) for b in per_rank] == [4, 4]


def test_determinism_per_seed_and_epoch():
    a = epoch_batches(TOY, 4, 2, 2, epoch=1, seed=3)
    assert a == epoch_batches(TOY, 4, 2, 2, epoch=1, seed=3)
    assert a != epoch_batches(TOY, 4, 2, 2, epoch=2, seed=3)
    assert a != epoch_batches(TOY, 4, 2, 2, epoch=1, seed=4)


@pytest.mark.parametrize("stop", [1, 2, 3, 5, 8])
def test_resume_continues_with_the_next_micro_batch(stop):
    kwargs = dict(num_replicas=2, rank=1, accumulate_grad_batches=2, seed=5)
    full = BatchRebalanceSampler(TOY[:61], 4, **kwargs)
    full.set_epoch(2)
    expected = list(full)
    assert full.state_dict() == {"epoch": 2, "position": 0}  # end of epoch
    first = BatchRebalanceSampler(TOY[:61], 4, **kwargs)
    first.set_epoch(2)
    consumed = list(itertools.islice(iter(first), stop))
    state = first.state_dict()
    assert state == {"epoch": 2, "position": stop}
    resumed = BatchRebalanceSampler(TOY[:61], 4, **kwargs)
    resumed.load_state_dict(state)
    assert consumed + list(resumed) == expected
    assert list(resumed) == expected  # the resume offset applies once


def test_rebalance_errors_name_the_fix():
    with pytest.raises(ValueError, match="lengths=None.*length_column_name.*sampling: random"):
        BatchRebalanceSampler(None, 2)
    with pytest.raises(ValueError, match="got length None for row 1"):
        BatchRebalanceSampler([3, None, 4], 2)
    with pytest.raises(ValueError, match="got length -1"):
        BatchRebalanceSampler([3, -1], 2)
    with pytest.raises(ValueError, match=r"batch_size=0\)` is invalid"):
        BatchRebalanceSampler([3, 4], 0)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=0\)` is invalid"):
        BatchRebalanceSampler([3, 4], 1, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="num_replicas=2, rank=2"):
        BatchRebalanceSampler([3, 4], 1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="3 ranks"):
        BatchRebalanceSampler([3, 4], 1, num_replicas=3, rank=0)
    with pytest.raises(ValueError, match="drop_last=True` would drop every sample"):
        BatchRebalanceSampler([3, 4, 5], 2, num_replicas=2, rank=0, drop_last=True)


def test_defaults_without_process_group_and_tensor_lengths():
    sampler = BatchRebalanceSampler(torch.tensor([5, 3, 9, 1]), 2)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert sorted(i for mb in sampler for i in mb) == [0, 1, 2, 3]


# ----------------------------------------------------------------------------------------------------------------
# LengthGroupedSampler and the group_by_length batch sampler
# ----------------------------------------------------------------------------------------------------------------


def test_length_grouped_matches_reference_megabatches():
    from transformers.trainer_pt_utils import LengthGroupedSampler as RefSampler

    lengths = TOY[:50]
    donors = 0
    for epoch in range(6):
        ours = LengthGroupedSampler(lengths, 4, seed=10)  # mult = min(50 // 16, 50) = 3: mega-batches of 12
        ours.set_epoch(epoch)
        got = list(ours)
        reference = list(RefSampler(4, lengths=lengths, generator=torch.Generator().manual_seed(10 + epoch)))
        assert sorted(got) == list(range(50))
        assert lengths[got[0]] == max(lengths)  # the longest sample first
        megas_ours = [got[i : i + 12] for i in range(0, 50, 12)]
        megas_ref = [reference[i : i + 12] for i in range(0, 50, 12)]
        for mine, theirs in zip(megas_ours, megas_ref):
            assert set(mine) == set(theirs)  # same seeded permutation, same mega-batches
            assert [lengths[i] for i in mine] == sorted((lengths[i] for i in mine), reverse=True)
        # the reference leaves the donor mega-batch unsorted at its head; every other one is identical
        differing = [k for k, (a, b) in enumerate(zip(megas_ours, megas_ref)) if a != b]
        assert len(differing) <= 1 and (not differing or differing[0] > 0)
        donors += len(differing)
    assert donors >= 2  # the longest row came from another mega-batch in some epochs: the re-sort was exercised


def test_length_grouped_hand_case_and_resume():
    lengths = [3, 9, 1, 7, 5, 2]
    sampler = LengthGroupedSampler(lengths, 6, seed=0)  # one mega-batch holding everything: fully sorted
    assert list(sampler) == [1, 3, 4, 0, 5, 2]
    sampler = LengthGroupedSampler(lengths, 1, seed=4, mega_batch_mult=2)
    sampler.set_epoch(1)
    expected = list(sampler)
    partial = LengthGroupedSampler(lengths, 1, seed=4, mega_batch_mult=2)
    partial.set_epoch(1)
    head = list(itertools.islice(iter(partial), 4))
    resumed = LengthGroupedSampler(lengths, 1, seed=4, mega_batch_mult=2)
    resumed.load_state_dict(partial.state_dict())
    assert head + list(resumed) == expected
    other = LengthGroupedSampler(lengths, 1, seed=4, mega_batch_mult=2)
    other.set_epoch(2)
    assert sorted(other) == list(range(6)) and list(other) != expected  # another epoch, another order
    with pytest.raises(ValueError, match="mega_batch_mult=0"):
        LengthGroupedSampler(lengths, 1, mega_batch_mult=0)


def test_group_by_length_batches_dealt_round_robin():
    n, batch_size, replicas, slots = 61, 3, 2, 2
    samplers = [
        make_length_grouped_batch_sampler(
            TOY[:n], batch_size=batch_size, seed=1, num_replicas=replicas, rank=r, accumulate_grad_batches=slots
        )
        for r in range(replicas)
    ]
    # mega-batch: min(61 // 12, 50 steps * 4 micro-batches) = 5 micro-batches = 15 samples
    assert samplers[0].index_sampler.mega_batch_mult == 5
    for s in samplers:
        s.set_epoch(1)
    per_rank = [list(s) for s in samplers]
    order = samplers[0].index_sampler.epoch_order(1)
    batches = [order[i : i + 3] for i in range(0, n, 3)]  # 21 batches: 20 full + [60]; round of 2 completed
    assert [len(b) for b in per_rank] == [11, 11] == [len(s) for s in samplers]
    assert per_rank[0][:10] == batches[0:20:2] and per_rank[1][:10] == batches[1:20:2]
    assert per_rank[0][10] == batches[20]
    assert per_rank[1][10] == order[:3]  # the last round is completed with the first indices (ShardedBatchSampler)
    assert lengths_of(per_rank[0][0])[0] == max(TOY[:n])


def lengths_of(batch):
    return [TOY[i] for i in batch]


# ----------------------------------------------------------------------------------------------------------------
# require_lengths and diagnostics
# ----------------------------------------------------------------------------------------------------------------


def test_require_lengths():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3], [4, 5, 6]], "length": [2, 1, 3]})
    assert require_lengths(ds, "length") == [2, 1, 3]
    assert require_lengths(ds.select([2, 0]), "length") == [3, 2]
    with pytest.raises(ValueError, match=r"sampling: group_by_length.*length_column_name='n_tokens'.*sampling: random"):
        require_lengths(ds, "n_tokens", sampling="group_by_length")
    with pytest.raises(ValueError, match="iterable.*sampling: random"):
        require_lengths(ds.to_iterable_dataset(), "length")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"length": 1}

    with pytest.raises(ValueError, match="sampling: batch_rebalance.*iterable"):
        require_lengths(Stream(), "length")
    holes = datasets.Dataset.from_dict({"length": [2, None]})
    with pytest.raises(ValueError, match="row 1.*length_column_name='length'"):
        require_lengths(holes, "length")


def test_padding_stats_and_cost_spread_hand_checked():
    stats = padding_stats(torch.tensor([5, 3, 2]), padded_length=6)
    # 3 rows x width 6 = 18 slots, 10 real tokens: padding 8/18; cost 18 + 0.001*3*36 = 18.108
    assert float(stats["tokens"]) == 10 and float(stats["padded_tokens"]) == 18
    assert float(stats["padding_fraction"]) == pytest.approx(8 / 18)
    assert float(stats["cost"]) == pytest.approx(18.108)
    default = padding_stats(torch.tensor([[4], [4]]))  # width = max = 4: no padding
    assert float(default["padding_fraction"]) == 0
    assert float(cost_spread(torch.tensor([18.108, 12.0, 9.054]))) == pytest.approx(0.5)  # (18.108-9.054)/18.108
    assert float(cost_spread(torch.tensor([0.0, 0.0]))) == 0


def test_cost_spread_per_column_of_a_window():
    # (world=3, steps=2): step 0 spreads (10 - 4) / 10, step 1 (5 - 0) / 5; a 1-D input is one column
    spreads = cost_spread(torch.tensor([[10.0, 5.0], [8.0, 5.0], [4.0, 0.0]]))
    assert spreads.tolist() == pytest.approx([0.6, 1.0])
    assert cost_spread(torch.zeros(2, 3)).tolist() == [0.0, 0.0, 0.0]  # empty steps: no spread, no division by 0
