"""``sampling="batch_rebalance"`` with packing: the cost model of packed micro-batches and the balance it gives.

``packing="padding_free"`` makes each micro-batch ONE flattened row, so it costs its total token count and the
sampler evens out the totals (``cost_model="packed"``); ``packing="bfd"`` bins are rows padded to the longest bin,
so the padded cost model applies to the bin lengths.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset

from helpers.accumulation import TEXTS, accum_datamodule, full_batch
from helpers.models import tiny_llama
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler
from lit_trainer.data.samplers.rebalance import balance_packed_step, balance_step
from lit_trainer.data.samplers.rebalance_sampler import BatchRebalanceSampler
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.modules.causal_lm import CausalLMModule

WORLD, ACCUMULATE, BATCH = 2, 2, 4


def corpus_lengths(n: int = 160, seed: int = 3) -> list[int]:
    """Mixed lengths 32..512, fixed seed."""
    return torch.randint(32, 513, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def packed_stragglers(per_rank: list[list[list[int]]], lengths: list[int]) -> list[int]:
    """Per step, ``sum over slots of max over ranks`` of the micro-batches' total tokens (``per_rank[r][k]``: rank
    ``r``'s ``k``-th micro-batch of the epoch; consecutive ``ACCUMULATE`` micro-batches form a step)."""
    totals = [[sum(lengths[i] for i in mb) for mb in batches] for batches in per_rank]
    slots = [max(rank[k] for rank in totals) for k in range(len(totals[0]))]
    return [sum(slots[s : s + ACCUMULATE]) for s in range(0, len(slots), ACCUMULATE)]


def test_packed_split_hand_case_uses_every_row_once():
    # padded: contiguous groups of the sorted rows; packed: 8+7 | 6+5+4 = 15 | 15 tokens (nothing is padded)
    plan = balance_packed_step([8, 7, 6, 5, 4], num_replicas=2, num_slots=1)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in mb[0]) for mb in plan) == [15, 15]
    lengths = corpus_lengths(40)
    plan = balance_packed_step(lengths, num_replicas=2, num_slots=3)
    rows = [i for rank in plan for mb in rank for i in mb]
    assert sorted(rows) == list(range(40)) and all(mb for rank in plan for mb in rank)
    assert len(plan) == 2 and all(len(rank) == 3 for rank in plan)
    with pytest.raises(ValueError, match="cannot fill 6 micro-batches"):
        balance_packed_step([5, 4, 3], num_replicas=2, num_slots=3)


def test_packed_cost_model_balances_each_slot_better_than_a_random_split():
    lengths = corpus_lengths()
    samplers = [
        BatchRebalanceSampler(
            lengths, BATCH, num_replicas=WORLD, rank=r, accumulate_grad_batches=ACCUMULATE, seed=0, cost_model="packed"
        )
        for r in range(WORLD)
    ]
    packed = [list(s) for s in samplers]
    assert sorted(i for rank in packed for mb in rank for i in mb) == list(range(len(lengths)))
    randoms = [
        list(ShardedBatchSampler(len(lengths), BATCH, shuffle=True, seed=0, num_replicas=WORLD, rank=r))
        for r in range(WORLD)
    ]
    padded = [
        list(
            BatchRebalanceSampler(
                lengths, BATCH, num_replicas=WORLD, rank=r, accumulate_grad_batches=ACCUMULATE, seed=0
            )
        )
        for r in range(WORLD)
    ]
    ours, rand, pad = (packed_stragglers(p, lengths) for p in (packed, randoms, padded))
    assert len(ours) == len(rand)
    assert all(a <= b for a, b in zip(ours, rand))  # every step, never worse than the plain random split
    assert sum(ours) < 0.95 * sum(rand)  # and clearly better over the epoch
    assert sum(ours) <= sum(pad)  # the padded model is not built for packed costs
    for k in range(len(packed[0])):  # each slot: the ranks' packed micro-batches carry near-equal token counts
        totals = [sum(lengths[i] for i in rank[k]) for rank in packed]
        assert (max(totals) - min(totals)) / max(totals) < 0.05, (k, totals)


def test_padded_model_is_unchanged_by_default():
    lengths = corpus_lengths(48)
    sampler = BatchRebalanceSampler(lengths, BATCH, num_replicas=WORLD, rank=0, accumulate_grad_batches=ACCUMULATE)
    assert sampler.cost_model == "padded"
    order = sampler._order(0)[: BATCH * ACCUMULATE * WORLD]
    expected = balance_step([lengths[i] for i in order], WORLD, ACCUMULATE)
    assert sampler.step_plan(0, 0) == [[[order[p] for p in mb] for mb in rank] for rank in expected]
    with pytest.raises(ValueError, match="cost_model='dense'"):
        BatchRebalanceSampler(lengths, BATCH, cost_model="dense")


@pytest.mark.parametrize(("packing", "cost_model"), [("none", "padded"), ("padding_free", "packed"), ("bfd", "padded")])
def test_data_module_picks_the_cost_model_from_packing(tokenizer, packing, cost_model):
    dm = SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS}),
        val_size=0,
        batch_size=2,
        max_length=64,
        sampling="batch_rebalance",
        packing=packing,
    )
    dm.setup("fit")
    sampler = dm.train_dataloader().batch_sampler
    assert isinstance(sampler, BatchRebalanceSampler) and sampler.cost_model == cost_model
    assert sampler.lengths == dm.lengths()  # bfd: the bins' token counts


@pytest.mark.parametrize("packing", ["padding_free", "bfd"])
def test_packed_batch_rebalance_fit_runs(tokenizer, packing):
    model = tiny_llama(seed=3)
    dm = SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS * 2}),
        val_size=0,
        batch_size=2,
        max_length=64,
        sampling="batch_rebalance",
        packing=packing,
    )
    module = CausalLMModule(copy.deepcopy(model), tokenizer=tokenizer, learning_rate=1e-2, warmup_steps=0)
    trainer = pl.Trainer(
        max_steps=2,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2
    moved = sum(float((p.detach() - q).abs().sum()) for p, q in zip(module.model.parameters(), model.parameters()))
    assert moved > 0


@pytest.mark.ddp
def test_ddp_padding_free_batch_rebalance_is_balanced_and_exact(ddp_world, tokenizer):
    """2 ranks (gloo), accumulate 2, batch_size 2: the one step holds all 8 rows. Each rank trains the packed
    sampler's micro-batches, and the step gradient equals the full-batch token-mean gradient."""
    out = ddp_world.part("grad_accum_padding_free_rebalance")  # ddp_grad_accum.py - padding_free batch_rebalance
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    lengths = dm.lengths()
    for r, facts in enumerate(ranks):
        plan = BatchRebalanceSampler(
            lengths, 2, num_replicas=2, rank=r, accumulate_grad_batches=2, seed=dm.hparams.seed, cost_model="packed"
        )
        assert [b.shape for b in facts["seen"]] == [(1, sum(lengths[i] for i in mb)) for mb in plan]
    totals = [[b.size(1) for b in facts["seen"]] for facts in ranks]
    random_split = [
        [
            sum(lengths[i] for i in mb)
            for mb in ShardedBatchSampler(8, 2, shuffle=True, seed=dm.hparams.seed, num_replicas=2, rank=r)
        ]
        for r in (0, 1)
    ]
    assert sum(map(max, zip(*totals))) < sum(map(max, zip(*random_split)))  # straggler tokens: 77 vs 118
    reference = full_batch(tiny_llama(seed=1), dm, list(range(8)))  # calibrated tolerance: helpers/rounding.py
    for facts in ranks:
        reference.check(facts["grads"][0])
