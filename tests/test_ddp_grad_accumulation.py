"""A real 2-process DDP run on CPU (gloo): token-exact accumulation across ranks."""

import csv

import pytest
import torch
from transformers import ByT5Tokenizer

from helpers.accumulation import accum_datamodule, full_batch
from helpers.models import tiny_llama

pytestmark = pytest.mark.ddp


def test_ddp_accumulation_equals_full_batch_gradient(ddp_world):
    out = ddp_world.part("grad_accum")  # tests/scripts/ddp_grad_accum.py
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    # each rank trained on 2 micro-batches of its own; together they are the 8 rows exactly once
    rows = [tuple(row[row != 0].tolist()) for r in ranks for batch in r["seen"] for row in batch]
    assert len(rows) == 8 and len(set(rows)) == 8
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 2
    # after the all-reduce, both ranks hold the same gradient = the full-batch token-mean gradient
    tokenizer = ByT5Tokenizer()
    dm = accum_datamodule(tokenizer, batch_size=2)
    dm.setup("fit")
    model = tiny_llama(seed=1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ranks[0]["initial"].items())
    reference = full_batch(model, dm, list(range(8)))  # and its float32 rounding scale (helpers/rounding.py)
    for r in ranks:
        assert len(r["grads"]) == 1
        reference.check(r["grads"][0])
    # the logged spread of padded-token cost between ranks: (max - min) / max of the two ranks' step costs
    costs = []
    for r in ranks:
        masks = [(batch != 0).long() for batch in r["seen"]]
        costs.append(sum(m.shape[0] * m.shape[1] * (1 + 0.001 * m.shape[1]) for m in masks))
    with open(out / "logs" / "version_0" / "metrics.csv", newline="") as file:
        row = [line for line in csv.DictReader(file) if line["cost_spread"]]
    assert len(row) == 1
    # tolerance: the logged value went through float32 and the CSV text; the formula is float64 on integers
    assert float(row[0]["cost_spread"]) == pytest.approx((max(costs) - min(costs)) / max(costs), rel=1e-5)


def test_ddp_limit_train_batches_cutting_the_window_is_exact(ddp_world):
    # accumulate 2 but limit_train_batches=1: each rank trains ONE micro-batch of 2 rows before the step
    out = ddp_world.part("grad_accum_limit_1")  # tests/scripts/ddp_grad_accum.py 1
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [len(r["seen"]) for r in ranks] == [1, 1]
    tokenizer = ByT5Tokenizer()
    dm = accum_datamodule(tokenizer, batch_size=2)
    dm.setup("fit")
    rows = {tuple(dm.train_dataset[i]["input_ids"]): i for i in range(8)}
    trained = [rows[tuple(row[row != 0].tolist())] for r in ranks for row in r["seen"][0]]
    assert len(set(trained)) == 4
    reference = full_batch(tiny_llama(seed=1), dm, trained)
    for r in ranks:
        assert len(r["grads"]) == 1
        reference.check(r["grads"][0])
