"""One validation-metrics path: the modules declare torchmetrics in ``self.val_metrics``, update them in
``validation_step``, and the base module computes, finalizes, logs and resets them once per validation.

Expected values are computed independently here (a full log-softmax for DPO, hand-made reward values for GRPO).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset
from torchmetrics import MeanMetric, MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from helpers.models import tiny_llama
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.metrics import ValidationMetrics
from lit_trainer.modules.causal_lm import CausalLMModule
from lit_trainer.modules.dpo import DPOModule
from lit_trainer.modules.grpo import GRPOModule

QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
PAIRS = {
    "prompt": ["1+2=", "100+200=", "5=", "a much longer prompt=", "7+8="],
    "chosen": ["3", "300", "5", "ok", "15"],
    "rejected": ["4", "301", "six", "not ok at all", "16"],
}


# ------------------------------------------------------------------------------------------------ the container
def test_only_updated_metrics_are_computed_with_the_prefix_and_reset():
    metrics = ValidationMetrics()
    metrics.add("loss", MeanMetric())
    metrics.add("rewards/chosen", MeanMetric())  # a "/" in the logged name
    metrics.add("never", MeanMetric())
    metrics["loss"].update(torch.tensor(2.0), weight=1)
    metrics["loss"].update(torch.tensor(5.0), weight=3)
    metrics["rewards/chosen"].update(torch.tensor(-1.0))
    assert metrics.compute() == {"val_loss": pytest.approx(4.25), "val_rewards/chosen": pytest.approx(-1.0)}
    metrics.reset()
    assert metrics.compute() == {}  # nothing updated since the reset
    metrics["never"].update(torch.tensor(7.0))
    assert metrics.compute() == {"val_never": pytest.approx(7.0)}


def test_a_collection_or_a_dict_valued_metric_is_logged_per_key():
    metrics = ValidationMetrics()
    metrics.add("user", MetricCollection({"total": SumMetric(), "mean": MeanMetric()}, prefix="my_"))
    for value in (1.0, 3.0):
        for metric in metrics["user"].values():
            metric.update(torch.tensor(value))
    assert metrics.compute() == {"val_my_total": pytest.approx(4.0), "val_my_mean": pytest.approx(2.0)}


def test_entries_with_the_same_name_keep_separate_states_and_the_last_is_logged():
    metrics = ValidationMetrics()
    first, second = metrics.add("r", MeanMetric()), metrics.add("r", MeanMetric())
    first.update(torch.tensor(1.0))
    second.update(torch.tensor(9.0))
    assert first.compute() == 1.0 and metrics.compute() == {"val_r": pytest.approx(9.0)}
    with pytest.raises(ValueError, match="invalid: a name must not be empty"):
        metrics.add("", MeanMetric())
    with pytest.raises(TypeError, match="torchmetrics `Metric` or `MetricCollection`"):
        metrics.add("x", torch.nn.Linear(1, 1))


def test_the_metrics_are_submodules_whose_states_stay_out_of_checkpoints():
    module = CausalLMModule(tiny_llama(0), tokenizer=transformers.ByT5Tokenizer())
    assert isinstance(module.val_metrics, ValidationMetrics)
    assert any(m is module.val_metrics["loss"] for m in module.modules())  # moved with the module's device
    assert not [k for k in module.state_dict() if k.startswith("val_metrics")]


# --------------------------------------------------------------------------------------------------- the modules
def test_causal_lm_logs_a_single_user_metric_by_its_class_name_and_no_exact_match_unless_asked():
    tokenizer = transformers.ByT5Tokenizer()
    rows = Dataset.from_dict({"text": ["12+34=46", "5+5=10", "1+1=2", "40+2=42"]})
    dm = SFTDataModule(tokenizer=tokenizer, dataset=rows, validation_dataset=rows, batch_size=2, max_length=16)
    accuracy = MulticlassAccuracy(num_classes=384, ignore_index=-100, average="micro")
    module = CausalLMModule(
        tiny_llama(1),
        tokenizer=tokenizer,
        eval_metrics=accuracy,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    logged = pl.Trainer(**QUIET).validate(module, datamodule=dm, verbose=False)[0]
    assert set(logged) == {"val_loss", "val_perplexity", "val_token_accuracy", "val_multiclassaccuracy"}
    assert logged["val_perplexity"] == pytest.approx(torch.tensor(logged["val_loss"]).exp().item(), rel=1e-6)


def test_dpo_validation_loss_adds_the_weighted_chosen_token_nll_and_logs_no_helper_metric():
    tokenizer = transformers.ByT5Tokenizer()
    dm = PreferenceDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict(PAIRS),
        validation_dataset=Dataset.from_dict(PAIRS),
        batch_size=2,
        eval_batch_size=2,
        max_length=32,
    )
    policy, ref, beta, sft_weight = tiny_llama(0), tiny_llama(1), 0.1, 2.0
    module = DPOModule(policy, ref_model=ref, loss_type=["sigmoid", "sft"], loss_weights=[1.0, sft_weight], beta=beta)
    logged = pl.Trainer(**QUIET).validate(module, datamodule=dm, verbose=False)[0]
    assert "val_sft_nll" not in logged and "val_sft__nll" not in logged
    assert {f"val_{n}" for n in ("rewards/chosen", "rewards/accuracies", "logps/rejected", "logits/chosen")} <= set(
        logged
    )
    # independent: every validation pair in one batch, a full log-softmax
    dm.setup("validate")
    data = dm.split_dataset("validation")
    batch = dm._collate([data[i] for i in range(len(data))], False)
    n = len(data)

    def token_logps(model):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        token = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        mask = batch["completion_mask"][:, 1:].float()
        return token * mask, mask

    (pi, mask), (rf, _) = token_logps(policy), token_logps(ref)
    u = pi.sum(-1) - rf.sum(-1)
    pair_loss = -F.logsigmoid(beta * (u[:n] - u[n:])).mean()
    chosen_nll = -pi[:n].sum() / mask[:n].sum()
    assert logged["val_loss"] == pytest.approx(float(pair_loss + sft_weight * chosen_nll), rel=1e-5)
    assert logged["val_rewards/accuracies"] == pytest.approx(float((u[:n] > u[n:]).float().mean()))


def constant_two(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    return [2.0] * len(prompts)


def odd_answer_or_none(prompts: list, completions: list, completion_ids: list, answer: list, **kw: Any) -> list:
    return [1.0 if int(a) % 2 else None for a in answer]


def test_grpo_validation_reward_is_the_weighted_nan_sum_and_per_function_means_ignore_none():
    prompts = Dataset.from_dict(
        {"prompt": [f"{10 + i}+11=" for i in range(4)], "answer": [str(21 + i) for i in range(4)]}
    )
    dm = PromptDataModule(
        tokenizer=transformers.ByT5Tokenizer(),
        dataset=prompts,
        validation_dataset=prompts,
        batch_size=4,
        eval_batch_size=2,
        max_length=16,
    )
    module = GRPOModule(
        tiny_llama(0),
        tokenizer=transformers.ByT5Tokenizer(),
        reward_funcs=[constant_two, odd_answer_or_none],
        reward_weights=[1.0, 3.0],
        num_generations=2,
        max_completion_length=2,
    )
    logged = pl.Trainer(**QUIET).validate(module, datamodule=dm, verbose=False)[0]
    # answers 21, 23 (odd): 2 + 3 * 1 = 5; answers 22, 24: 2 (None is skipped by the weighted sum)
    assert logged["val_reward"] == pytest.approx(3.5)
    assert logged["val_rewards/constant_two/mean"] == pytest.approx(2.0)
    assert logged["val_rewards/odd_answer_or_none/mean"] == pytest.approx(1.0)


def test_token_loss_and_accuracy_are_means_over_the_shifted_targets():
    from lit_trainer.metrics import token_loss_and_accuracy

    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [5.0, 5.0]], [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    labels = torch.tensor([[7, 0, 1], [-100, -100, -100]])  # targets 0 (uniform logits), 1 (logits 2, 0); no others
    loss, accuracy, count = token_loss_and_accuracy(logits, labels)
    assert count.item() == 2
    assert loss.item() == pytest.approx((math.log(2.0) + math.log(1.0 + math.e**2)) / 2, rel=1e-6)
    assert accuracy.item() == 0.5  # argmax 0 is right for the first target, wrong for the second
