"""RewardModule against TRL 1.16's ``RewardTrainer`` on the same model, rows and batch: the token ids it feeds (every
preference format, the max_length filter), the loss, the gradients and the metrics of one batch.

TRL is given the in-memory tiny model and tokenizer of ``lit_trainer.models`` (nothing is downloaded), on the CPU in
float32 without gradient checkpointing; one batch goes through its ``compute_loss`` and through
``RewardModule.compute_loss``. The rewards are the same forward of the same weights on the same ids, so they and the
metrics computed from them are equal exactly. The loss is a mean in TRL and a per-pair sum divided by the pair count
here (what accumulation needs), which may differ in the last bit: the loss and gradient comparisons are calibrated
(``tests/helpers/rounding.py``) by the same computation in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset

from helpers.rounding import Rounding, relative_l2
from lit_trainer import RewardModule
from lit_trainer.data import PreferenceDataModule
from lit_trainer.models import load_model, load_tokenizer

trl = pytest.importorskip("trl")

PROMPTS = ["12+34=", "5+5=", "99+1=", "7+80="]
CHOSEN = ["46", "10", "100", "87"]
REJECTED = ["47", "11", "10", "78"]
MARGIN = [0.5, 0.0, 1.0, 2.0]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


FORMATS = {
    "standard_explicit": {"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED},
    "standard_implicit": {
        "chosen": [p + c for p, c in zip(PROMPTS, CHOSEN)],
        "rejected": [p + r for p, r in zip(PROMPTS, REJECTED)],
    },
    "conversational_explicit": {
        "prompt": [_user(p) for p in PROMPTS],
        "chosen": [_assistant(c) for c in CHOSEN],
        "rejected": [_assistant(r) for r in REJECTED],
    },
    "conversational_implicit": {
        "chosen": [_user(p) + _assistant(c) for p, c in zip(PROMPTS, CHOSEN)],
        "rejected": [_user(p) + _assistant(r) for p, r in zip(PROMPTS, REJECTED)],
    },
}


def _trl_trainer(model, tokenizer, rows: dict, tmp_path, max_length: int | None = None, center: float | None = None):
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_length=max_length,
        center_rewards_coefficient=center,
    )
    return trl.RewardTrainer(model=model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tokenizer)


def _trl_batch(trainer) -> dict[str, torch.Tensor]:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])


def _our_batch(tokenizer, rows: dict, max_length: int = 64) -> dict[str, torch.Tensor]:
    dm = PreferenceDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict(rows),
        val_size=0,
        batch_size=len(PROMPTS),
        max_length=max_length,
        truncation_mode="drop",
        sampling="sequential",
    )
    dm.setup("fit")
    return dm._collate([dm.train_dataset[i] for i in range(len(dm.train_dataset))], True)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny", task="sequence_classification"), load_tokenizer("tiny")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_same_token_ids_as_trl(fmt, tiny, tmp_path):
    model, tokenizer = tiny
    expected = _trl_batch(_trl_trainer(copy.deepcopy(model), tokenizer, FORMATS[fmt], tmp_path))
    ours = _our_batch(tokenizer, FORMATS[fmt])
    assert torch.equal(ours["input_ids"], expected["input_ids"])
    assert torch.equal(ours["attention_mask"], expected["attention_mask"])


def test_max_length_drops_the_same_pairs_as_trl(tiny, tmp_path):
    """TRL keeps a pair only when both rows fit in max_length; truncation_mode='drop' keeps the same pairs."""
    model, tokenizer = tiny
    rows = FORMATS["standard_explicit"]  # chosen/rejected rows of 9/9, 7/7, 9/8 and 8/8 tokens (with EOS)
    trainer = _trl_trainer(copy.deepcopy(model), tokenizer, rows, tmp_path, max_length=8)
    expected = _trl_batch(trainer)
    ours = _our_batch(tokenizer, rows, max_length=8)
    assert len(trainer.train_dataset) == 2  # the filter did bite
    assert torch.equal(ours["input_ids"], expected["input_ids"])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _ours(model, tokenizer, batch, center: float | None, dtype=torch.float32):
    module = RewardModule(copy.deepcopy(model).to(dtype), tokenizer=tokenizer, center_rewards_coefficient=center)
    module.train()
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}
    loss, metrics = module.compute_loss(batch, None)
    loss.backward()
    return loss.detach(), _grads(module.model), metrics


@pytest.mark.parametrize("with_margin", [False, True], ids=["no_margin", "margin"])
def test_loss_gradients_and_metrics_match_trl(with_margin, tiny, tmp_path):
    model, tokenizer = tiny
    rows = dict(FORMATS["standard_explicit"], **({"margin": MARGIN} if with_margin else {}))
    center = 0.01
    trainer = _trl_trainer(copy.deepcopy(model), tokenizer, rows, tmp_path, center=center)
    batch = _trl_batch(trainer)
    assert ("margin" in batch) == with_margin
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, dict(batch))
    trl_loss.backward()
    trl_grads = _grads(trainer.model)

    ours_batch = _our_batch(tokenizer, rows)
    assert torch.equal(ours_batch["input_ids"], batch["input_ids"])
    assert ("margin" in ours_batch) == with_margin
    loss, grads, metrics = _ours(model, tokenizer, ours_batch, center)
    loss64, grads64, _ = _ours(model, tokenizer, ours_batch, center, torch.float64)

    # a real mistake: the loss without its margin (or without the centring term)
    wrong_loss, wrong_grads, _ = _ours(model, tokenizer, {k: v for k, v in ours_batch.items() if k != "margin"}, None)
    values = lambda x: {"loss": x.reshape(1)}
    Rounding.of(values(loss), values(loss64), what="loss").check(
        values(loss), values(trl_loss.detach()), mistake=relative_l2(values(wrong_loss), values(loss))
    )
    Rounding.of(grads, grads64, what="gradient").check(grads, trl_grads, mistake=relative_l2(wrong_grads, grads))
    assert grads.keys() == trl_grads.keys() and "score.weight" in grads
    print(f"TRL loss difference {abs(loss - trl_loss).item():.2e}, gradient {relative_l2(grads, trl_grads):.2e}")

    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}
    assert set(trl_metrics) == {"accuracy", "margin", "mean_reward", "min_reward", "max_reward"}
    for name, value in trl_metrics.items():  # the same rewards: equal up to the float32 mean's summation order
        assert metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-7), name
