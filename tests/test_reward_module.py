"""RewardModule: fit and validation metrics, accumulation against a full batch, export, LoRA, gradient checkpointing,
and the refusals (packing, a model with more than one output, a LoRA config of another task)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, LlamaForCausalLM

from helpers.accumulation import calibrated, fit_grads
from lit_trainer import RewardModule
from lit_trainer.callbacks import HFExport
from lit_trainer.data import PreferenceDataModule, builtin
from lit_trainer.losses import reward_loss
from lit_trainer.models import load_model, load_tokenizer

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def _rows(split: str, n: int) -> Dataset:
    return builtin.preference_rows(split).select(range(n))


def _datamodule(train: int = 16, val: int = 0, batch_size: int = 4, **kwargs) -> PreferenceDataModule:
    return PreferenceDataModule(
        tokenizer=load_tokenizer("tiny"),
        dataset=_rows("train", train),
        validation_dataset=_rows("validation", val) if val else None,
        val_size=0,
        batch_size=batch_size,
        eval_batch_size=kwargs.pop("eval_batch_size", 7),
        max_length=32,
        truncation_mode="drop",
        sampling=kwargs.pop("sampling", "sequential"),
        **kwargs,
    )


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return load_model("tiny", task="sequence_classification")


def _trainer(max_steps: int, **kwargs) -> pl.Trainer:
    options = {"limit_val_batches": 0, "num_sanity_val_steps": 0, "enable_checkpointing": False, **kwargs}
    return pl.Trainer(
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _all_rewards(model: torch.nn.Module, dm: PreferenceDataModule) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected rewards of the whole validation set, one row at a time (no padding at all)."""
    chosen, rejected = [], []
    model.eval()
    with torch.no_grad():
        for row in dm.val_dataset:
            for ids, out in ((row["chosen_ids"], chosen), (row["rejected_ids"], rejected)):
                out.append(model(input_ids=torch.tensor([row["prompt_ids"] + ids])).logits[0, 0])
    return torch.stack(chosen), torch.stack(rejected)


def test_validation_metrics_are_over_the_whole_set():
    """30 validation pairs in eval batches of 7 (a short last batch): the logged values are the set's."""
    module = RewardModule(_model(), tokenizer=load_tokenizer("tiny"), learning_rate=1e-3)
    dm = _datamodule(val=30)
    trainer = _trainer(3, limit_val_batches=None)
    trainer.fit(module, datamodule=dm)
    logged = trainer.validate(module, datamodule=dm, verbose=False)[0]
    chosen, rejected = _all_rewards(module.model, dm)
    both = torch.cat([chosen, rejected])
    expected = {
        "val_loss": reward_loss(chosen, rejected).mean(),
        "val_accuracy": (chosen > rejected).float().mean(),
        "val_margin": (chosen - rejected).mean(),
        "val_mean_reward": both.mean(),
        "val_min_reward": both.min(),
        "val_max_reward": both.max(),
        "val_chosen_reward": chosen.mean(),
        "val_rejected_reward": rejected.mean(),
    }
    assert set(expected) <= set(logged)
    for name, value in expected.items():  # batched (padded) vs one row at a time: float32 rounding of the forward
        assert logged[name] == pytest.approx(value.item(), rel=1e-4, abs=1e-5), name
    assert expected["val_accuracy"] not in (0.0, 1.0)  # a batch-mean of means would differ from the set's mean


def _full_batch_gradient(model: torch.nn.Module, dm: PreferenceDataModule, rows: list[int]) -> dict:
    batch = dm._collate([dm.train_dataset[i] for i in rows], True)
    model.zero_grad()
    rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    chosen, rejected = rewards.chunk(2)
    reward_loss(chosen, rejected, center_rewards_coefficient=0.01).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def test_accumulation_equals_the_full_batch_gradient_with_a_short_last_window():
    """9 pairs in micro-batches of 2 (the last has 1), accumulate 2: steps of 4, 4 and 1 pairs (a short last
    window). Each step's gradient is the mean over its pairs; lr 0 keeps the weights for the comparison."""
    model = _model()
    dm = _datamodule(train=9, batch_size=2)
    dm.setup("fit")
    module = RewardModule(
        copy.deepcopy(model), tokenizer=load_tokenizer("tiny"), learning_rate=0.0, center_rewards_coefficient=0.01
    )
    grads = fit_grads(module, dm, accumulate=2, max_steps=3)
    assert len(grads) == 3
    for step, rows in enumerate([[0, 1, 2, 3], [4, 5, 6, 7], [8]]):
        # a real mistake: a pair lost (or, for the one-pair step, Lightning's halving of a short window)
        mistake = (lambda m, rows=rows: _full_batch_gradient(m, dm, rows[:-1])) if len(rows) > 1 else 0.5
        reference = calibrated(lambda m, rows=rows: _full_batch_gradient(m, dm, rows), model, mistake=mistake)
        reference.check(grads[step])


def test_fit_logs_the_metrics_and_exports_a_sequence_classifier(tmp_path):
    dm = _datamodule(train=64, val=32, batch_size=16)
    module = RewardModule(_model(), tokenizer=load_tokenizer("tiny"), learning_rate=3e-3)
    trainer = _trainer(12, callbacks=[HFExport(str(tmp_path / "hf"))], log_every_n_steps=4)
    trainer.fit(module, datamodule=dm)
    assert {"accuracy", "margin", "mean_reward", "min_reward", "max_reward"} <= set(trainer.callback_metrics)
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert exported.config.num_labels == 1 and exported.config.pad_token_id == dm.pad_token_id
    batch = dm._collate([dm.val_dataset[i] for i in range(8)], False)
    module.eval()
    with torch.no_grad():
        assert torch.equal(exported(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits.squeeze(-1),
                           module(batch["input_ids"], batch["attention_mask"]))  # fmt: skip


def test_lora_trains_and_saves_the_score_head(tmp_path):
    peft = pytest.importorskip("peft")
    base = _model()
    start = base.score.weight.detach().clone()
    module = RewardModule(copy.deepcopy(base), tokenizer=load_tokenizer("tiny"), learning_rate=1e-2, peft_config=LORA)
    assert module.model.peft_config["default"].task_type == "SEQ_CLS"
    dm = _datamodule(train=32, val=8, batch_size=8)
    adapter, merged = HFExport(str(tmp_path / "adapter")), HFExport(str(tmp_path / "merged"), merge_adapters=True)
    _trainer(4, callbacks=[adapter, merged]).fit(module, datamodule=dm)
    score = [p for n, p in module.model.named_parameters() if "score" in n and p.requires_grad]
    assert score and not torch.equal(score[0].detach(), start)  # the head was trained
    batch = dm._collate([dm.val_dataset[i] for i in range(8)], False)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    module.eval()
    with torch.no_grad():
        expected = module(**inputs)
        from_adapter = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
        from_merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(from_adapter(**inputs).logits.squeeze(-1), expected, rtol=0, atol=0)
        # merging adds the low-rank product into the weights: a float32 rounding of the sum, no more
        torch.testing.assert_close(from_merged(**inputs).logits.squeeze(-1), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, base.eval()(**inputs).logits.squeeze(-1), atol=1e-3)  # it did train


def test_gradient_checkpointing_gives_the_same_gradient():
    dm = _datamodule(train=8, batch_size=8)
    dm.setup("fit")
    batch = dm._collate([dm.train_dataset[i] for i in range(8)], True)
    grads = []
    for checkpointing in (False, True):
        module = RewardModule(_model(), tokenizer=load_tokenizer("tiny"), gradient_checkpointing=checkpointing)
        module.train()
        module.compute_loss(dict(batch), None)[0].backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
    assert module.model.is_gradient_checkpointing
    for name, grad in grads[0].items():  # the same operations recomputed: the same float32 results
        assert torch.equal(grad, grads[1][name]), name


def test_packing_is_refused_with_the_reason():
    dm = _datamodule(packing="padding_free")
    with pytest.raises(ValueError, match="packing='padding_free'.*one position per row.*packing='none'"):
        _trainer(1).fit(RewardModule(_model(), tokenizer=load_tokenizer("tiny")), datamodule=dm)


def test_refusals_at_construction():
    torch.manual_seed(0)
    causal = load_model("tiny")
    assert isinstance(causal, LlamaForCausalLM)
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModule(load_model("tiny", task="sequence_classification", num_labels=2))
    with pytest.raises(ValueError, match="task_type='CAUSAL_LM'.*SEQ_CLS"):
        RewardModule("tiny", peft_config={**LORA, "task_type": "CAUSAL_LM"})
    with pytest.raises(ValueError, match="center_rewards_coefficient=-0.1"):
        RewardModule("tiny", center_rewards_coefficient=-0.1)


def test_causal_lm_export_gets_a_score_head_and_pad_id(tmp_path):
    torch.manual_seed(0)
    load_model("tiny").save_pretrained(tmp_path / "lm")
    load_tokenizer("tiny").save_pretrained(tmp_path / "lm")
    module = RewardModule(str(tmp_path / "lm"))
    assert module.model.config.num_labels == 1 and module.text_config.pad_token_id == 0


def test_drop_mode_drops_pairs_that_do_not_fit():
    rows = Dataset.from_dict({"prompt": ["1+1=", "10+10="], "chosen": ["2", "20"], "rejected": ["3", "200"]})
    dm = PreferenceDataModule(
        tokenizer=load_tokenizer("tiny"), dataset=rows, val_size=0, max_length=9, truncation_mode="drop"
    )
    dm.setup("fit")  # "10+10=200</s>" has 10 tokens: that pair goes, whole
    assert len(dm.train_dataset) == 1 and dm.stats["train_rows_dropped_too_long"] == 1
    assert dm.stats["train_rows_truncated"] == 0


@pytest.mark.slow
def test_recipe_runs_with_the_console_script_and_exports_a_reward_model(tmp_path):
    from helpers.cli import CONFIGS, QUIET_FIT
    from helpers.ddp import output_tail, run_lit_trainer

    data = tmp_path / "pairs.jsonl"
    _rows("train", 40).to_json(data)  # the recipe's data module on a small file: the tokenizing takes no time
    args = ["fit", "--config", CONFIGS / "reward.yaml", "--trainer.max_steps=3", "--trainer.log_every_n_steps=1"]
    quick = ["--data.init_args.batch_size=8", f"--data.init_args.dataset={data}"]
    proc = run_lit_trainer(*args, *QUIET_FIT, *quick, cwd=tmp_path)
    assert proc.returncode == 0, output_tail(proc)
    run = tmp_path / "runs" / "reward" / "version_0"
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train_loss", "accuracy", "margin", "mean_reward"} <= set(header)
    model = AutoModelForSequenceClassification.from_pretrained(run / "hf_model")
    assert model.config.num_labels == 1


@pytest.mark.parametrize("margins", [[1.0, None], [1.0, float("nan")], ["1", "0.5"]], ids=["null", "nan", "text"])
def test_a_bad_margin_is_named(margins):
    rows = Dataset.from_dict({"prompt": ["1+1=", "2+2="], "chosen": ["2", "4"], "rejected": ["3", "5"]})
    rows = rows.add_column("margin", margins)
    dm = PreferenceDataModule(tokenizer=load_tokenizer("tiny"), dataset=rows, val_size=0, max_length=16)
    with pytest.raises(ValueError, match=f"'margin' column holds .* at row {1 if margins[0] == 1.0 else 0}"):
        dm.setup("fit")


def test_resume_from_a_checkpoint_is_bit_exact(tmp_path):
    """6 steps straight vs the same 6-step run resumed from its step-2 checkpoint (shuffled data, accumulation 2):
    same weights. (Stopping a 2-step run and raising max_steps would change the learning-rate schedule itself.)"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_trainer.callbacks import ExactResume

    def run(max_steps: int, ckpt_path: str | None = None, save: bool = False) -> dict[str, torch.Tensor]:
        pl.seed_everything(7)
        module = RewardModule(_model(), tokenizer=load_tokenizer("tiny"), learning_rate=3e-3, warmup_steps=2)
        callbacks = [ExactResume()]
        if save:
            callbacks.append(
                ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
            )
        trainer = _trainer(max_steps, accumulate_grad_batches=2, callbacks=callbacks, enable_checkpointing=save)
        trainer.fit(module, datamodule=_datamodule(train=20, batch_size=3, sampling="random"), ckpt_path=ckpt_path)
        return {k: v.detach().clone() for k, v in module.model.state_dict().items()}

    straight = run(6, save=True)
    resumed = run(6, ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert all(torch.equal(resumed[k], v) for k, v in straight.items())
