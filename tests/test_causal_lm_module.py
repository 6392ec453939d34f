"""CausalLMModule logging and validation semantics, checked against hand computations."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from torchmetrics.classification import MulticlassAccuracy

from helpers.logs import fit_train_loss_rows
from helpers.models import tiny_llama
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.modules.causal_lm import CausalLMModule

TEXTS = ["ab", "longer row of text", "xyz", "mid row", "q", "another long row!", "hi", "row 8"]


def _dm(tokenizer, **kw):
    dm = SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS}),
        validation_dataset=Dataset.from_dict({"text": TEXTS[:5]}),
        batch_size=2,
        eval_batch_size=2,
        max_length=64,
        sampling="sequential",
        **kw,
    )
    dm.setup("fit")
    return dm


def test_logged_train_loss_is_the_window_mean_of_step_losses(tokenizer, tmp_path):
    model = tiny_llama(seed=0)
    dm = _dm(tokenizer)
    module = CausalLMModule(copy.deepcopy(model), tokenizer=tokenizer, learning_rate=0.0)
    rows = fit_train_loss_rows(module, dm, tmp_path, max_steps=4, every=2)
    assert [int(r["step"]) for r in rows] == [1, 3]
    # lr = 0: the weights never move, so each step's loss is the token mean of its micro-batch (rows 2k, 2k+1)
    step_losses, padding = [], []
    for k in range(4):
        batch = dm._collate([dm.train_dataset[i] for i in (2 * k, 2 * k + 1)], True)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        step_losses.append(float(causal_lm_loss(logits, batch["labels"])))
        padding.append((batch["attention_mask"].numel(), int(batch["attention_mask"].sum())))
    for r, (a, b) in zip(rows, [(0, 1), (2, 3)]):
        assert float(r["train_loss"]) == pytest.approx((step_losses[a] + step_losses[b]) / 2, rel=1e-5)
        total, real = padding[a][0] + padding[b][0], padding[a][1] + padding[b][1]
        assert float(r["padding_fraction"]) == pytest.approx(1 - real / total, rel=1e-5)
        assert float(r["tokens_per_sec"]) > 0 and float(r["grad_norm"]) > 0


def test_validation_loss_is_the_global_token_mean_and_user_metrics_stream(tokenizer):
    model = tiny_llama(seed=1)
    dm = _dm(tokenizer)
    accuracy = MulticlassAccuracy(num_classes=384, ignore_index=-100, average="micro")
    module = CausalLMModule(
        copy.deepcopy(model),
        tokenizer=tokenizer,
        eval_metrics={"acc": accuracy},
        preprocess_logits_for_metrics=lambda logits, labels: logits[:, :-1].argmax(-1),
    )
    # shift labels to match the preprocessed predictions: done by wrapping update
    original_update = accuracy.update
    accuracy.update = lambda preds, labels: original_update(preds, labels[:, 1:])
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, datamodule=dm, verbose=False)[0]
    batch = dm._collate([dm.val_dataset[i] for i in range(5)], False)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = causal_lm_loss(logits, batch["labels"])  # one batch of all 5 rows: the global token mean
    assert metrics["val_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert metrics["val_perplexity"] == pytest.approx(float(expected.exp()), rel=1e-5)
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    token_acc = float(((logits[:, :-1].argmax(-1) == targets) & mask).sum() / mask.sum())
    assert metrics["val_token_accuracy"] == pytest.approx(token_acc, rel=1e-5)
    assert metrics["val_acc"] == pytest.approx(token_acc, rel=1e-5)


def test_exact_match_metric_counts_correct_greedy_completions(tokenizer):
    from lit_trainer.metrics import greedy_exact_match

    # EOS = 1, pad = 0; targets are -100 padded and end with EOS
    generated = torch.tensor([[55, 56, 1, 0], [55, 57, 1, 0], [55, 56, 56, 1], [55, 56, 9, 9]])
    targets = torch.tensor([[55, 56, 1], [55, 56, 1], [55, 56, 1], [55, 56, 1]])
    assert greedy_exact_match(generated, targets, eos_token_id=1).tolist() == [True, False, False, False]


def test_exact_match_ignores_what_a_chat_template_writes_after_the_end_of_turn():
    """ChatML (SmolLM2, Qwen) ends an assistant turn with ``<|im_end|>`` then a newline: the reference completion of a
    chat row is "6<|im_end|>\n", the greedy answer "6<|im_end|>". Before the fix, the newline stayed in the
    reference and no answer ever matched (val_exact_match 0 on every ChatML model)."""
    from lit_trainer.metrics import greedy_exact_match

    # ids of SmolLM2's tokenizer: 38 = "6", 29 = "-", 33 = "1", 2 = <|im_end|> (EOS and pad), 198 = "\n"
    generated = torch.tensor([[38, 2, 2, 2], [29, 33, 2, 2], [38, 198, 2, 2], [29, 33, 33, 2]])
    targets = torch.tensor([[38, 2, 198, -100], [29, 33, 2, 198], [38, 2, 198, -100], [29, 33, 2, 198]])
    assert greedy_exact_match(generated, targets, eos_token_id=2).tolist() == [True, True, False, False]
    # generation_config.eos_token_id may be a list: any of its ids ends a completion
    assert greedy_exact_match(generated, targets, eos_token_id=[0, 2]).tolist() == [True, True, False, False]


def test_invalid_module_options():
    with pytest.raises(ValueError, match="`warmup_steps=-1` is invalid"):
        CausalLMModule("tiny-64", warmup_steps=-1)
    with pytest.raises(ValueError, match="`max_grad_norm=-1.0` is invalid"):
        CausalLMModule("tiny-64", max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="`eval_max_new_tokens=0` is invalid"):
        CausalLMModule("tiny-64", eval_max_new_tokens=0)


def test_scheduler_warmup_then_cosine_per_optimizer_step(tokenizer):
    module = CausalLMModule(tiny_llama(), tokenizer=tokenizer, learning_rate=1.0, warmup_steps=2, scheduler="cosine")
    lrs = []

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=1,
        logger=False,
        limit_val_batches=0,
        callbacks=[Record()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=_dm(tokenizer))
    # HF warmup: step / warmup = 0, 1/2; then cosine over the remaining 2 steps: 0.5*(1+cos(pi*0/2)) = 1.0,
    # 0.5*(1+cos(pi*1/2)) = 0.5
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.5])
    assert [g["weight_decay"] for g in trainer.optimizers[0].param_groups] == [0.0, 0.0]


def test_default_optimizer_decays_matrices_only_not_biases_or_norms():
    module = CausalLMModule(tiny_llama(), tokenizer=None, weight_decay=0.1)
    optimizer = module.create_optimizer(list(module.trainable_parameters()))
    names = {id(p): n for n, p in module.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in optimizer.param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert decay and all("norm" not in n and "bias" not in n for n in decay)
    assert "model.model.norm.weight" in no_decay and all("norm" in n or "bias" in n for n in no_decay)
