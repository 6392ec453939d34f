"""Padding waste and straggler cost of the training samplers, ours against the HF reference (not a test).

Usage::

    python benchmarks/sampling.py [--rows 4096] [--batch-size 8] [--seeds 3]

For three length distributions (uniform, long-tailed log-normal, bimodal), world sizes ``W`` in {2, 4, 8} and
accumulation ``GA`` in {1, 2, 4}, on the same lengths:

* **Same steps** (partition quality): every optimizer step of our ``BatchRebalanceSampler`` is also split by
  ``transformers.trainer_pt_utils.BatchRebalanceSampler`` (given exactly that step's samples, through its public
  iterator), so the figures measure balancing, not the luck of a permutation.
* **Epoch**: each sampler over a whole epoch with its own order: random (``ShardedBatchSampler``), our
  ``group_by_length`` and ``batch_rebalance``, and the reference's ``LengthGroupedSampler`` (batches dealt
  round-robin to ranks, as accelerate does) and ``BatchRebalanceSampler``.

Metrics, summed over steps and seeds: padding waste = padded minus real tokens (``bs * max_len - sum(len)`` per
micro-batch); straggler cost = sum over (step, slot) of the maximum over ranks of the micro-batch cost
``bs * max_len + 0.001 * bs * max_len**2`` (the time the slowest rank makes the others wait at each sync).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence

import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler as RefRebalance
from transformers.trainer_pt_utils import LengthGroupedSampler as RefGrouped

from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler
from lit_trainer.data.samplers.length_grouped import make_length_grouped_batch_sampler
from lit_trainer.data.samplers.rebalance import microbatch_cost
from lit_trainer.data.samplers.rebalance_sampler import BatchRebalanceSampler

Steps = list[list[list[list[int]]]]  # steps[step][rank][slot] = dataset indices

DISTRIBUTIONS: dict[str, Callable[[random.Random], int]] = {
    "uniform": lambda rng: rng.randint(16, 1024),
    "lognormal": lambda rng: min(4096, max(8, int(rng.lognormvariate(5.5, 0.8)))),
    "bimodal": lambda rng: rng.randint(16, 128) if rng.random() < 0.7 else rng.randint(512, 1024),
}
WORLD_SIZES, ACCUMULATIONS = (2, 4, 8), (1, 2, 4)


def measure(lengths: Sequence[int], steps: Steps) -> tuple[int, float]:
    """(padding waste in tokens, straggler cost) of ``steps``."""
    waste, straggler = 0, 0.0
    for step in steps:
        for slot in range(len(step[0])):
            costs = []
            for per_rank in step:
                rows = [lengths[i] for i in per_rank[slot]]
                waste += len(rows) * max(rows) - sum(rows)
                costs.append(microbatch_cost(len(rows), max(rows)))
            straggler += max(costs)
    return waste, straggler


def to_steps(per_rank: list[list[list[int]]], accumulate: int) -> Steps:
    """Per-rank micro-batch streams -> steps[step][rank][slot] (windows of ``accumulate`` micro-batches)."""
    count = len(per_rank[0])
    return [[stream[s : s + accumulate] for stream in per_rank] for s in range(0, count, accumulate)]


def ref_split(lengths: Sequence[int], indices: list[int], world: int, accumulate: int) -> list[list[list[int]]]:
    """The reference's split of exactly ``indices`` (one step), through its public iterator, rank by rank."""
    step_lengths = [lengths[i] for i in indices]
    plan = []
    for rank in range(world):
        sampler = RefRebalance(step_lengths, len(indices), world, accumulate, shuffle=False, rank=rank, drop_last=True)
        plan.append([[indices[p] for p in mb] for mb in sampler])
    return plan


def same_steps(lengths: Sequence[int], world: int, accumulate: int, batch: int, seed: int) -> dict[str, float]:
    """Our split and the reference's split of the SAME step sample sets; timings per step."""
    sampler = BatchRebalanceSampler(
        lengths, batch, num_replicas=world, rank=0, accumulate_grad_batches=accumulate, seed=seed
    )
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()  # epoch 0's order
    out = {"ours_waste": 0, "ours_strag": 0.0, "ref_waste": 0, "ref_strag": 0.0, "ours_s": 0.0, "ref_s": 0.0}
    for step in range(len(sampler.steps)):
        start, end, _ = sampler.steps[step]
        indices = order[start:end]
        t0 = time.perf_counter()
        mine = sampler.step_plan(0, step)
        t1 = time.perf_counter()
        theirs = ref_split(lengths, indices, world, accumulate)
        t2 = time.perf_counter()
        assert sorted(i for r in mine for mb in r for i in mb) == sorted(indices)
        assert sorted(i for r in theirs for mb in r for i in mb) == sorted(indices)
        for key, plan in (("ours", mine), ("ref", theirs)):
            waste, strag = measure(lengths, [plan])
            out[f"{key}_waste"] += waste
            out[f"{key}_strag"] += strag
        out["ours_s"] += t1 - t0
        out["ref_s"] += (t2 - t1) / world  # the reference is run once per rank here; count one split
    out["steps"] = len(sampler.steps)
    return out


def epoch_samplers(lengths: Sequence[int], world: int, accumulate: int, batch: int, seed: int) -> dict[str, Steps]:
    """Every sampler's epoch as steps[step][rank][slot]."""
    n = len(lengths)
    streams: dict[str, list[list[list[int]]]] = {
        "random": [list(ShardedBatchSampler(n, batch, seed=seed, num_replicas=world, rank=r)) for r in range(world)],
        "gbl_ours": [
            list(
                make_length_grouped_batch_sampler(
                    lengths, batch_size=batch, seed=seed, num_replicas=world, rank=r, accumulate_grad_batches=accumulate
                )
            )
            for r in range(world)
        ],
        "reb_ours": [
            list(
                BatchRebalanceSampler(
                    lengths, batch, num_replicas=world, rank=r, accumulate_grad_batches=accumulate, seed=seed
                )
            )
            for r in range(world)
        ],
        "reb_ref": [
            list(
                RefRebalance(
                    list(lengths), batch * accumulate * world, world, accumulate, seed=seed, rank=r, drop_last=False
                )
            )
            for r in range(world)
        ],
    }
    order = list(RefGrouped(batch * accumulate, lengths=list(lengths), generator=torch.Generator().manual_seed(seed)))
    batches = [order[i : i + batch] for i in range(0, n, batch)]  # the DataLoader's batches, dealt round-robin
    streams["gbl_ref"] = [batches[r::world] for r in range(world)]
    return {name: to_steps(per_rank, accumulate) for name, per_rank in streams.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="dataset rows (a multiple of 256: no tails)")
    parser.add_argument("--batch-size", type=int, default=8, help="(average) micro-batch size per rank")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    names = ("random", "gbl_ours", "gbl_ref", "reb_ours", "reb_ref")
    same_rows, epoch_rows, totals = [], [], {"ours_waste": 0, "ref_waste": 0, "gbl_ours": 0, "gbl_ref": 0}
    timing = {"ours_s": 0.0, "ref_s": 0.0, "steps": 0}
    for dist, draw in DISTRIBUTIONS.items():
        for world in WORLD_SIZES:
            for accumulate in ACCUMULATIONS:
                same = {k: 0.0 for k in ("ours_waste", "ours_strag", "ref_waste", "ref_strag")}
                epoch = {name: [0, 0.0] for name in (*names, "real")}
                for seed in range(args.seeds):
                    rng = random.Random(f"{dist}-{seed}")
                    lengths = [draw(rng) for _ in range(args.rows)]
                    epoch["real"][0] += sum(lengths)
                    res = same_steps(lengths, world, accumulate, args.batch_size, seed)
                    for k in same:
                        same[k] += res[k]
                    for k in timing:
                        timing[k] += res[k]
                    for name, steps in epoch_samplers(lengths, world, accumulate, args.batch_size, seed).items():
                        waste, strag = measure(lengths, steps)
                        epoch[name][0] += waste
                        epoch[name][1] += strag
                totals["ours_waste"] += same["ours_waste"]
                totals["ref_waste"] += same["ref_waste"]
                totals["gbl_ours"] += epoch["gbl_ours"][0]
                totals["gbl_ref"] += epoch["gbl_ref"][0]
                same_rows.append((dist, world, accumulate, same))
                epoch_rows.append((dist, world, accumulate, epoch))
                print(f"done {dist} W={world} GA={accumulate}", flush=True)
    report(same_rows, epoch_rows, totals, timing, args)
    large_grouped(args)


def large_grouped(args: argparse.Namespace, rows: int = 65536, world: int = 8) -> None:
    """``group_by_length`` where the mega-batch cap binds: ours spans 50 optimizer steps, the reference 50 / W."""
    print(
        f"\n### group_by_length on {rows} rows, W={world}, GA=1, B={args.batch_size}: padding waste (% of padded "
        f"tokens), {args.seeds} seeds\n"
    )
    print("| lengths | ours | reference |")
    print("|---|---|---|")
    for dist, draw in DISTRIBUTIONS.items():
        waste = {"ours": 0, "ref": 0}
        real = 0
        for seed in range(args.seeds):
            rng = random.Random(f"large-{dist}-{seed}")
            lengths = [draw(rng) for _ in range(rows)]
            real += sum(lengths)
            ours = [
                list(
                    make_length_grouped_batch_sampler(
                        lengths, batch_size=args.batch_size, seed=seed, num_replicas=world, rank=r
                    )
                )
                for r in range(world)
            ]
            order = list(RefGrouped(args.batch_size, lengths=lengths, generator=torch.Generator().manual_seed(seed)))
            batches = [order[i : i + args.batch_size] for i in range(0, rows, args.batch_size)]
            ref = [batches[r::world] for r in range(world)]
            waste["ours"] += measure(lengths, to_steps(ours, 1))[0]
            waste["ref"] += measure(lengths, to_steps(ref, 1))[0]
        print(
            f"| {dist} | {100 * waste['ours'] / (waste['ours'] + real):.2f}% | "
            f"{100 * waste['ref'] / (waste['ref'] + real):.2f}% |"
        )


def pct(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.1f}%"


def report(same_rows: list, epoch_rows: list, totals: dict, timing: dict, args: argparse.Namespace) -> None:
    names = ("random", "gbl_ours", "gbl_ref", "reb_ours", "reb_ref")
    print(
        f"\n### Same step sample sets: our `batch_rebalance` split vs the reference's "
        f"({args.rows} rows, B={args.batch_size}, {args.seeds} seeds)\n"
    )
    print("| lengths | W | GA | straggler ours | straggler ref | Δ straggler | waste ours | waste ref | Δ waste |")
    print("|---|---|---|---|---|---|---|---|---|")
    deltas, worse, more_waste, waste_deltas = [], 0, 0, []
    for dist, world, accumulate, s in same_rows:
        deltas.append(s["ours_strag"] / s["ref_strag"] - 1)
        worse += s["ours_strag"] > s["ref_strag"]
        more_waste += s["ours_waste"] > s["ref_waste"]
        waste_deltas.append(s["ours_waste"] / s["ref_waste"] - 1)
        print(
            f"| {dist} | {world} | {accumulate} | {s['ours_strag']:.4g} | {s['ref_strag']:.4g} | "
            f"{pct(s['ours_strag'], s['ref_strag'])} | {int(s['ours_waste'])} | {int(s['ref_waste'])} | "
            f"{pct(s['ours_waste'], s['ref_waste'])} |"
        )
    print(
        "\n### Whole epochs, each sampler with its own order: padding waste (% of padded tokens) and straggler "
        "cost relative to random\n"
    )
    print(
        "| lengths | W | GA | waste random | waste gbl ours | waste gbl ref | waste reb ours | waste reb ref | "
        "strag gbl ours | strag gbl ref | strag reb ours | strag reb ref |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dist, world, accumulate, e in epoch_rows:
        waste = [f"{100 * e[name][0] / (e[name][0] + e['real'][0]):.1f}%" for name in names]
        strag = [f"{e[name][1] / e['random'][1]:.3f}" for name in names[1:]]
        print(f"| {dist} | {world} | {accumulate} | " + " | ".join(waste + strag) + " |")
    mean = sum(deltas) / len(deltas)
    print("\n### Summary against the goals\n")
    print(
        f"- batch_rebalance, same steps: straggler {100 * mean:+.2f}% on average vs the reference (goal <= -3%); "
        f"worse than the reference on {worse} of {len(deltas)} settings (goal 0); best {100 * min(deltas):+.1f}%, "
        f"worst {100 * max(deltas):+.1f}%."
    )
    print(
        f"- batch_rebalance, same steps: padding waste {pct(totals['ours_waste'], totals['ref_waste'])} in total "
        f"vs the reference (goal <= 0); more waste on {more_waste} of {len(deltas)} settings, worst "
        f"{100 * max(waste_deltas):+.1f}% (goal: never above +5%)."
    )
    print(
        f"- group_by_length, whole epochs over {args.seeds} seeds: padding waste "
        f"{pct(totals['gbl_ours'], totals['gbl_ref'])} in total vs the reference (goal <= 0)."
    )
    steps = max(timing["steps"], 1)
    print(
        f"- split time per step: ours {1000 * timing['ours_s'] / steps:.2f} ms, reference "
        f"{1000 * timing['ref_s'] / steps:.2f} ms (mean over {steps} steps)."
    )


if __name__ == "__main__":
    main()
