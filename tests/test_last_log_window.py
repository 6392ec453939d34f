"""The last logging window of a run that ends between two logging steps is written, not dropped."""

import copy

import pytest
from datasets import Dataset

from helpers.logs import fit_train_loss_rows
from helpers.models import tiny_llama
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.modules.causal_lm import CausalLMModule

TEXTS = ["ab", "longer row of text", "xyz", "mid row", "q", "another long row!", "hi", "row 8", "ten", "row 10"]


@pytest.mark.parametrize(("steps", "every", "expected"), [(5, 2, [1, 3, 4]), (3, 50, [2]), (4, 2, [1, 3])])
def test_the_partial_last_window_is_logged_once(tokenizer, tmp_path, steps, every, expected):
    model = tiny_llama(seed=0)
    dm = SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS}),
        batch_size=2,
        val_size=0,
        max_length=64,
        sampling="sequential",
    )
    dm.setup("fit")
    module = CausalLMModule(copy.deepcopy(model), tokenizer=tokenizer, learning_rate=0.0)
    rows = fit_train_loss_rows(module, dm, tmp_path, steps, every)
    assert [int(r["step"]) for r in rows] == expected
    # lr = 0: each step's loss is the token mean of its micro-batch (rows 2k, 2k+1); the last row's window is the
    # steps after the previous logged step
    losses = []
    for k in range(steps):
        batch = dm._collate([dm.train_dataset[i] for i in (2 * k, 2 * k + 1)], True)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        losses.append(float(causal_lm_loss(logits, batch["labels"])))
    first = expected[-2] + 1 if len(expected) > 1 else 0
    window = losses[first : expected[-1] + 1]
    assert float(rows[-1]["train_loss"]) == pytest.approx(sum(window) / len(window), rel=1e-5)
    assert float(rows[-1]["learning_rate"]) == 0.0 and rows[-1]["epoch"] == "0"
