"""Splitting one optimizer step's samples into balanced micro-batches (``sampling: batch_rebalance``).

Cost model of one micro-batch (as the reference batch-rebalance sampler):
``cost = bs * max_len + 0.001 * bs * max_len**2``, the padded tokens plus an attention term. Internally costs are exact
integers, ``1000 * cost = bs * max_len * (1000 + max_len)``, so every rank computes bit-identical partitions. With one
micro-batch per rank the split is exactly optimal (integer binary search on the cost cap); with several, a dynamic
program over cost caps replaces the reference's hill climbing (see :func:`balance_step`). numpy only.

Cost models (``CostModel``): ``"padded"`` is the one above, for right-padded micro-batches and for ``packing="bfd"``
(whose items are bins, each one row, padded to the longest bin of the micro-batch: the same formula on bin lengths).
``"packed"`` is for ``packing="padding_free"``: the micro-batch is one flattened row, so it costs its total token
count (:func:`packed_microbatch_cost`) and :func:`balance_packed_step` splits the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

CostModel = Literal["padded", "packed"]
COST_MODELS: tuple[str, ...] = get_args(CostModel)

QUADRATIC_COST_COEF = 0.001
_SCALE = 1000  # 1 / QUADRATIC_COST_COEF: integer costs are scaled by this
_GRID_STEP = 100  # slot-cap grid of the step DP: consecutive caps differ by 1/_GRID_STEP (1%), coarser if needed
_DP_CELL_BUDGET = 400_000  # table cells per DP (about 10 ms); larger steps use a coarser grid or skip a refinement
_STEP_CELL_BUDGET = 4_000_000  # the whole-step waste DP (one table row of `band` cells per sample and group)


def microbatch_cost(batch_size: int, max_len: int) -> float:
    """Cost of one micro-batch, ``bs * max_len + 0.001 * bs * max_len**2``.

    Example:
        >>> microbatch_cost(3, 414)  # 3*414 + 0.001*3*414**2 = 1242 + 514.188
        1756.188
    """
    return batch_size * max_len + QUADRATIC_COST_COEF * batch_size * max_len * max_len


def _unit(length: int) -> int:
    """1000 x the cost of one row of ``length`` tokens (a length-0 row is costed as one token)."""
    length = max(int(length), 1)
    return length * (_SCALE + length)


# ---------------------------------------------------------------------------------------------------------------
# One optimizer step: split m samples (sorted by length, descending) into `slots x W` contiguous groups.
# `w[i]` is the integer unit cost of sorted sample i; a group [i, j) costs (j - i) * w[i].
# ---------------------------------------------------------------------------------------------------------------


def _greedy_counts(w: Sequence[int], slots: int, width: int, base: int) -> list[int] | None:
    """Fill ``slots`` slots of ``width`` groups left to right, each group as large as its slot cap allows.

    A slot starting at sample ``i`` has cap ``max(base, w[i])``; every group leaves at least one sample for each
    group after it. Returns the group sizes, or ``None`` when the samples are not all covered.
    """
    m, total, i, counts = len(w), slots * width, 0, []
    for _ in range(slots):
        cap = max(base, w[i])
        for _ in range(width):
            most = m - i - (total - len(counts) - 1)
            take = min(cap // w[i], most)
            counts.append(take)
            i += take
    return counts if i == m else None


def _minimax_counts(w: Sequence[int], slots: int, width: int) -> list[int]:
    """Smallest base cap (integer binary search) for which :func:`_greedy_counts` covers all samples.

    With ``slots == 1`` this is the exact minimum over all contiguous splits of the maximum group cost; with more
    slots the largest group still has that minimum cost, and slots that start with a costly sample absorb more.
    """
    groups = slots * width  # the minimax cost C* lies in (lo, hi]: a group costs >= each member, and the
    lo = max(w[0], -(-sum(w) // groups)) - 1  # group of sample 0 >= w[0]; equal counts cost <= ceil(m/K) * w[0]
    hi = -(-len(w) // groups) * w[0]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _greedy_counts(w, slots, width, mid) is None:
            lo = mid
        else:
            hi = mid
    counts = _greedy_counts(w, slots, width, hi)
    assert counts is not None  # hi is always feasible
    return counts


def _group_costs(w: Sequence[int], counts: Sequence[int]) -> list[int]:
    costs, i = [], 0
    for count in counts:
        costs.append(count * w[i])
        i += count
    return costs


def _straggler(costs: Sequence[int], width: int) -> int:
    """Sum over slots of the slot maximum when groups are dealt to slots by descending cost (optimal for a sum)."""
    return sum(sorted(costs, reverse=True)[::width])


def _cap_grid(lo: int, hi: int, size: int) -> np.ndarray | None:
    """At most ``size`` integer slot caps from ``lo`` to ``hi``, geometric: 1% apart, coarser if needed (integer
    arithmetic, so identical on every rank). ``None`` if even doubling steps need more."""
    for divisor in (_GRID_STEP, 50, 20, 10, 5, 2, 1):
        caps, cap = [], max(lo, 1)
        while cap < hi and len(caps) < size:
            caps.append(cap)
            cap = max(cap + 1, cap + cap // divisor)
        if cap >= hi:
            return np.asarray(caps + [hi], dtype=np.int64)
    return None


def _slot_bounds(w: Sequence[int], slots: int, width: int, upper: int) -> list[int] | None:
    """Slot boundaries minimising the sum of slot caps (dynamic programming over a 1% grid of caps, coarser for
    very large steps).

    ``reach[i, g]``: how far ``width`` greedy groups of cap ``grid[g]`` get from sample ``i``; any end in
    ``[i + width, reach]`` is feasible and the cost of the rest never grows with a later start, so the best end for
    a cap is ``reach`` itself. ``F_s(i) = min_g grid[g] + F_{s-1}(reach[i, g])``. Returns ``None`` when the tables
    would exceed the cell budget.
    """
    m = len(w)
    wa = np.asarray(w, dtype=np.int64)
    grid = _cap_grid(int(wa[m - width]), upper, _DP_CELL_BUDGET // (m + 1) - 1)
    if grid is None:
        return None
    rows = np.arange(m + 1)[:, None]
    one = np.minimum(m, rows + grid[None, :] // np.append(wa, 1)[:, None])  # one group of cap grid[g] from i
    one[m] = m
    reach, power, k = np.broadcast_to(rows, one.shape).copy(), one, width
    while k:  # reach = one composed `width` times (binary lifting)
        if k & 1:
            reach = np.take_along_axis(power, reach, axis=0)
        power, k = np.take_along_axis(power, power, axis=0), k >> 1
    inf = np.int64(2**62)
    best = np.where((reach >= m) & (rows <= m - width), grid[None, :], inf).min(axis=1)
    choices = []
    for left in range(1, slots):  # `left` slots remain after the one starting at i
        end = np.minimum(reach, m - left * width)
        cost = np.where(end >= rows + width, grid[None, :] + best[end], inf)
        pick = cost.argmin(axis=1)
        choices.append(end[np.arange(m + 1), pick])
        best = np.minimum(cost[np.arange(m + 1), pick], inf)
    if best[0] >= inf:
        return None
    bounds, i = [0], 0
    for end in reversed(choices):
        i = int(end[i])
        bounds.append(i)
    return bounds + [m]


def _least_padding_under_caps(
    lengths: Sequence[int],
    w: Sequence[int],
    caps: Sequence[int],
    budget: int = _DP_CELL_BUDGET,
    max_size: int | None = None,
) -> list[int] | None:
    """Split the sorted samples into ``len(caps)`` contiguous groups, group ``k`` costing at most ``caps[k]``, with
    the fewest padded tokens (exact DP).

    ``P_k(i)``: fewest padded tokens of samples ``[i, b)`` in groups ``k..``; a group from ``i`` holds at most
    ``caps[k] // w[i]`` samples, so the table is a band. Returns ``None`` when it would exceed the cell budget or no
    split fits (the caller keeps its split).
    """
    b, groups = len(w), len(caps)
    la, wa = np.asarray(lengths, dtype=np.int64), np.asarray(w, dtype=np.int64)
    band = int(min(max(caps) // wa.min(), b - groups + 1, max_size or b))
    if band < 1 or b * band * groups > budget:
        return None
    starts = np.arange(b)
    size = np.arange(1, band + 1)[None, :]
    ends = starts[:, None] + size  # group [i, i + size)
    cost = size * wa[:, None]
    padded = size * la[:, None]
    inf = np.int64(2**62)
    best = np.full(b + 1, inf)
    best[:b] = np.where((b - starts) * wa <= caps[-1], la * (b - starts), inf)  # the last group is [i, b)
    picks = []
    for k in range(groups - 2, -1, -1):  # `groups - 1 - k` groups follow the one starting at i
        fits = (cost <= caps[k]) & (ends <= b - (groups - 1 - k))
        total = np.where(fits, padded + best[np.minimum(ends, b)], inf)
        pick = total.argmin(axis=1)
        picks.append(pick + 1)
        best[:b] = np.minimum(total[starts, pick], inf)
    if best[0] >= inf:
        return None
    counts, i = [], 0
    for pick in reversed(picks):
        counts.append(int(pick[i]))
        i += counts[-1]
    return counts + [b - i]


def _rank_caps(costs: Sequence[int], width: int) -> list[int]:
    """Per-group caps that keep the straggler cost of a split with group ``costs``: group ``k`` may cost up to the
    largest cost of its rank block (ranks ``0..width-1`` by descending cost, then the next ``width``, ...).

    The caps are the ranked costs with each block raised to its maximum, permuted back to the groups, so ``costs``
    itself fits them; and any split whose group ``k`` costs at most ``caps[k]`` has, sorted descending, costs no larger
    than the sorted caps, hence a straggler cost (sum of the block maxima) no larger than ``costs``'s.
    """
    ranked = sorted(range(len(costs)), key=lambda k: -costs[k])
    caps = [0] * len(costs)
    for position, k in enumerate(ranked):
        caps[k] = costs[ranked[position - position % width]]
    return caps


def _polish(lengths: Sequence[int], w: Sequence[int], width: int, bounds: Sequence[int]) -> list[int]:
    """Per slot ``[a, b)``: the exact minimax cap of its samples, then the least-padding split under that cap."""
    counts: list[int] = []
    for a, b in itertools.pairwise(bounds):
        split = _minimax_counts(w[a:b], 1, width)
        cap = max(_group_costs(w[a:b], split))
        counts += _least_padding_under_caps(lengths[a:b], w[a:b], [cap] * width) or split
    return counts


def _best_counts(lengths: Sequence[int], w: Sequence[int], slots: int, width: int) -> list[int]:
    """Group sizes for one step: the best (straggler cost, then padded tokens) of the candidate splits."""
    uniform = _minimax_counts(w, slots, width)
    candidates = [uniform, _polish(lengths, w, width, np.cumsum([0, *uniform]).tolist()[::width])]
    if slots > 1:
        bounds = _slot_bounds(w, slots, width, _straggler(_group_costs(w, uniform), width))
        if bounds is not None:
            candidates.append(_polish(lengths, w, width, bounds))

    def score(counts: list[int]) -> tuple[int, int]:
        ends = np.cumsum(counts)
        return _straggler(_group_costs(w, counts), width), sum(c * lengths[e - c] for c, e in zip(counts, ends))

    best = min(candidates, key=score)
    least = _waste_tie_break(lengths, w, width, best)
    return least if least is not None and score(least) < score(best) else best


def _waste_tie_break(lengths: Sequence[int], w: Sequence[int], width: int, best: list[int]) -> list[int] | None:
    """The fewest padded tokens over the whole step among the splits whose groups fit :func:`_rank_caps` of ``best``
    (so with a straggler cost no larger than ``best``'s; groups at most twice ``best``'s largest). Samples may
    change slots; ``best`` itself fits, so the result never has more padding. ``None`` past the cell budget."""
    caps = _rank_caps(_group_costs(w, best), width)
    return _least_padding_under_caps(lengths, w, caps, _STEP_CELL_BUDGET, 2 * max(best))


def balance_step(lengths: Sequence[int], num_replicas: int, num_slots: int) -> list[list[list[int]]]:
    """Split one optimizer step's samples into ``num_slots`` micro-batches for each of ``num_replicas`` ranks.

    The samples are sorted by length (descending, stable) and cut into ``K = num_replicas * num_slots`` contiguous
    groups; groups are dealt to slots by descending cost (slot 0 holds the ``W`` costliest groups), and within a slot
    the costliest group goes to the rank with the lowest running cost in this step. The split minimises the
    straggler cost ``sum over slots of max over ranks of the micro-batch cost``:

    * ``num_slots == 1``: exactly (integer binary search on the cost cap + greedy fill: the minimum over all
      contiguous splits of the maximum group cost);
    * ``num_slots > 1``: a dynamic program over slot boundaries on a 1% grid of slot caps, each slot then split
      exactly; the result is never worse than the uniform minimax split (also computed; the better one is kept);
    * padding waste breaks ties: the straggler-best split is replaced by the split with the fewest padded tokens
      over the whole step among those whose groups fit under its per-rank-block cost caps (so never a higher
      straggler cost; exact DP, samples may change slots, see :func:`_waste_tie_break`).

    Args:
        lengths: the step's sample lengths (any order).
        num_replicas: ranks ``W``.
        num_slots: micro-batches per rank in this step (``accumulate_grad_batches``, fewer in a short tail step).

    Returns:
        ``plan[rank][slot]``: positions into ``lengths``, longest first.

    Raises:
        ValueError: if there are fewer samples than micro-batches.

    Example:
        >>> # {466, 414} | {56, 36} costs max(2*466*1.466, 2*56*1.056) = 1366.3, better than
        >>> # {466} | {414, 56, 36} with max(466*1.466, 3*414*1.414) = 1756.2
        >>> balance_step([466, 36, 414, 56], num_replicas=2, num_slots=1)
        [[[0, 2]], [[3, 1]]]
    """
    order = _sorted_order(lengths, num_replicas * num_slots)
    sorted_lengths = [max(int(lengths[p]), 1) for p in order]
    w = [_unit(length) for length in sorted_lengths]
    total = num_replicas * num_slots
    counts = _best_counts(sorted_lengths, w, num_slots, num_replicas) if len(order) > total else [1] * total
    starts = np.cumsum([0, *counts]).tolist()
    groups = [order[starts[g] : starts[g + 1]] for g in range(total)]
    return _deal(groups, _group_costs(w, counts), num_replicas, num_slots)


def _sorted_order(lengths: Sequence[int], total: int) -> list[int]:
    """Positions of ``lengths``, longest first (stable); refuses fewer samples than ``total`` micro-batches."""
    if len(lengths) < total:
        raise ValueError(
            f"{len(lengths)} samples cannot fill {total} micro-batches (num_replicas x num_slots): "
            f"need at least {total}."
        )
    return sorted(range(len(lengths)), key=lambda p: -lengths[p])


def _deal(groups: list[list[int]], costs: Sequence[int], num_replicas: int, num_slots: int) -> list[list[list[int]]]:
    """Deal the step's groups to slots by descending cost (slot 0 gets the ``num_replicas`` costliest); within a slot
    the costliest group goes to the rank with the lowest running cost in this step. Returns ``plan[rank][slot]``."""
    ranked = sorted(range(len(groups)), key=lambda g: -costs[g])
    plan: list[list[list[int]]] = [[] for _ in range(num_replicas)]
    load = [0] * num_replicas
    for slot in range(num_slots):
        ranks = sorted(range(num_replicas), key=lambda r: load[r])
        for r, g in zip(ranks, ranked[slot * num_replicas : (slot + 1) * num_replicas]):
            plan[r].append(groups[g])
            load[r] += costs[g]
    return plan


def packed_microbatch_cost(total_tokens: int) -> int:
    """Cost of one padding-free micro-batch (``packing="padding_free"``): its total token count.

    The whole micro-batch is ONE row with no padding, so its linear work is its token count. Its attention term is
    per sequence with the flash varlen kernels and grows with ``total_tokens**2`` with a dense mask (``sdpa``,
    ``eager``); both are increasing functions of the total, so :func:`balance_packed_step`, which evens out the totals,
    balances either. The linear count is also what the training module logs as a packed batch's cost.

    Example:
        >>> packed_microbatch_cost(3 + 5 + 2)
        10
    """
    return int(total_tokens)


def balance_packed_step(lengths: Sequence[int], num_replicas: int, num_slots: int) -> list[list[list[int]]]:
    """:func:`balance_step` for padding-free micro-batches (``packing="padding_free"``): a micro-batch costs its total
    token count (:func:`packed_microbatch_cost`), so rows need not be grouped by length (nothing is padded).

    The ``num_replicas * num_slots`` micro-batches are filled longest row first, each row into the micro-batch with
    the fewest tokens so far (the LPT rule: every micro-batch gets a row, and the largest total is at most 4/3 of the
    best possible), then a move-or-swap pass between the fullest and the emptiest micro-batch lowers the largest
    total while it can. The micro-batches are dealt to slots and ranks as in :func:`balance_step`. Deterministic
    (integer arithmetic, ties by index), so every rank computes the same plan.

    Example:
        >>> balance_packed_step([8, 7, 6, 5, 4], num_replicas=2, num_slots=1)  # 8+7 | 6+5+4 = 15 | 15
        [[[2, 3, 4]], [[0, 1]]]
    """
    total = num_replicas * num_slots
    order = _sorted_order(lengths, total)
    size = [max(int(n), 1) for n in lengths]
    groups: list[list[int]] = [[] for _ in range(total)]
    tokens = [0] * total
    for p in order:
        g = min(range(total), key=lambda k: (tokens[k], k))
        groups[g].append(p)
        tokens[g] += size[p]
    for _ in range(len(order)):
        if not _improve(groups, tokens, size):
            break
    groups = [sorted(g, key=lambda p: (-size[p], p)) for g in groups]
    return _deal(groups, tokens, num_replicas, num_slots)


def _improve(groups: list[list[int]], tokens: list[int], size: Sequence[int]) -> bool:
    """Move one row from the fullest to the emptiest group, or swap one row of each, choosing the exchange that
    brings the two totals closest; ``False`` when none lowers the fullest total (nothing changed)."""
    hi = max(range(len(tokens)), key=lambda k: (tokens[k], -k))
    lo = min(range(len(tokens)), key=lambda k: (tokens[k], k))
    gap = tokens[hi] - tokens[lo]
    best: tuple[int, int, int | None] | None = None  # (new gap, row of hi, row of lo or None for a move)
    for a in groups[hi]:
        options = [(None, size[a])] if len(groups[hi]) > 1 else []
        options += [(b, size[a] - size[b]) for b in groups[lo] if size[b] < size[a]]
        for b, delta in options:
            if 0 < delta < gap and (best is None or abs(gap - 2 * delta) < best[0]):
                best = (abs(gap - 2 * delta), a, b)
    if best is None:
        return False
    _, a, b = best
    groups[hi].remove(a)
    groups[lo].append(a)
    tokens[hi] -= size[a]
    tokens[lo] += size[a]
    if b is not None:
        groups[lo].remove(b)
        groups[hi].append(b)
        tokens[lo] -= size[b]
        tokens[hi] += size[b]
    return True


# ---------------------------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------------------------
