"""Token-exact accumulation: one optimizer step's gradient equals the full-batch token-mean gradient.

See docs/design.md#accumulation.
"""

import copy

import lightning.pytorch as pl
import pytest
import torch

from helpers.accumulation import (
    accum_datamodule,
    calibrated,
    fit_grads,
    full_batch,
    full_batch_gradient,
    relative_error,
)
from helpers.models import tiny_llama
from lit_trainer.modules.causal_lm import CausalLMModule


def _fit(model, tokenizer, dm, accumulate, max_steps, **module_kwargs):
    module = CausalLMModule(model, tokenizer=tokenizer, max_grad_norm=None, learning_rate=0.0, **module_kwargs)
    return fit_grads(module, dm, accumulate, max_steps)


def test_accumulation_equals_full_batch_gradient(tokenizer):
    model = tiny_llama(seed=1)
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    lengths = [int(n) for n in dm.train_dataset["length"]]
    assert max(lengths) > 8 * min(lengths)  # the micro-batches really are uneven
    reference = full_batch(model, dm, list(range(8)))  # and its float32 rounding scale (helpers/rounding.py)
    grads = _fit(copy.deepcopy(model), tokenizer, dm, accumulate=4, max_steps=1)
    assert len(grads) == 1
    reference.check(grads[0])


def test_short_last_window_is_exact(tokenizer):
    # 8 rows, batch 2 -> 4 micro-batches per epoch; accumulate 3 -> windows [0,1,2] and a short last window [3]
    model = tiny_llama(seed=2)
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    grads = _fit(copy.deepcopy(model), tokenizer, dm, accumulate=3, max_steps=2)
    assert len(grads) == 2
    full_batch(model, dm, list(range(6))).check(grads[0])
    # lr=0: the weights did not move, so the second step's reference uses the same model
    full_batch(model, dm, [6, 7]).check(grads[1])


def test_plain_lightning_division_would_be_wrong(tokenizer):
    """Guard that the test data is discriminative: the mean of per-micro-batch means differs a lot."""
    model = tiny_llama(seed=1)
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    reference = full_batch_gradient(copy.deepcopy(model), dm, list(range(8)))
    parts = [full_batch_gradient(copy.deepcopy(model), dm, [2 * i, 2 * i + 1]) for i in range(4)]
    mean_of_means = {k: sum(p[k] for p in parts) / 4 for k in reference}
    assert relative_error(mean_of_means, reference) > 0.05


def test_compute_loss_func_receives_documented_arguments(tokenizer):
    calls = []

    def my_loss(outputs, labels, num_items_in_batch=None):
        calls.append((outputs.logits.shape, labels.clone(), num_items_in_batch))
        # a deliberately different loss: 3 x the mean logit; its gradient is what must reach the weights
        return 3.0 * outputs.logits.mean()

    model = tiny_llama(seed=3)
    dm = accum_datamodule(tokenizer, batch_size=4)
    dm.setup("fit")
    grads = _fit(copy.deepcopy(model), tokenizer, dm, accumulate=2, max_steps=1, compute_loss_func=my_loss)
    assert len(calls) == 2
    batches = [dm._collate([dm.train_dataset[i] for i in range(4 * k, 4 * k + 4)], True) for k in range(2)]
    window_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for (shape, labels, n), batch in zip(calls, batches):
        assert torch.equal(labels, batch["labels"])  # unshifted labels
        assert shape[:2] == labels.shape
        assert float(n) == window_tokens  # target tokens of the whole step

    # what was backpropagated is exactly the user's value: sum over the window of 3 * mean(logits)
    def user_gradient(ref_model):
        sum(
            3.0 * ref_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.mean() for b in batches
        ).backward()
        return {n: p.grad for n, p in ref_model.named_parameters()}

    # tolerance: the same sum's float32 rounding, measured against its float64 twin (helpers/rounding.py); a real
    # mistake, Lightning's division of each micro-batch's value by accumulate_grad_batches=2, is off by half
    calibrated(user_gradient, model, mistake=0.5, what="user loss gradient").check(grads[0])


def test_fallback_without_item_counts_warns(tokenizer):
    model = tiny_llama(seed=4)
    module = CausalLMModule(model, tokenizer=tokenizer)
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    loader = torch.utils.data.DataLoader(
        [dm.train_dataset[i] for i in range(8)], batch_size=2, collate_fn=lambda rows: dm._collate(rows, True)
    )
    trainer = pl.Trainer(
        max_steps=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="NOT token-exact"):
        trainer.fit(module, train_dataloaders=loader)
