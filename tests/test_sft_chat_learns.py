"""A chat fit learns: the tiny preset on builtin:addition_chat with assistant_only_loss, a short bounded run.

The loss is on the assistant's tokens only ("82</s>"), about ln(384) = 5.95 per token untrained. The full recipe
(configs/sft_chat.yaml, 1500 steps) is measured in docs/benchmarks.md; this test runs 100 steps of batch 32 on one
thread (about 40 CPU-seconds): validation loss 6.02 -> 1.33, token accuracy 0.06 -> 0.51 when measured.
"""

import lightning.pytorch as pl
import pytest
import torch

from lit_trainer import CausalLMModule
from lit_trainer.data import SFTDataModule

pytestmark = pytest.mark.slow


def test_chat_fit_learns_the_assistant_answers(tmp_path):
    pl.seed_everything(1234)
    dm = SFTDataModule(
        dataset="builtin:addition_chat", assistant_only_loss=True, max_length=128, batch_size=32, eval_batch_size=100
    )
    module = CausalLMModule(
        "tiny",
        learning_rate=3e-3,
        warmup_steps=10,
        scheduler="constant_with_warmup",
        eval_exact_match=True,
        eval_max_new_tokens=5,
    )
    # inference_mode=False: validate() then fit() on one module (metric states made under inference mode can't update)
    trainer = pl.Trainer(
        max_steps=100,
        limit_val_batches=1,
        val_check_interval=100,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        inference_mode=False,
    )
    before = {k: float(v) for k, v in trainer.validate(module, datamodule=dm, verbose=False)[0].items()}
    trainer.fit(module, datamodule=dm)
    after = {k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, torch.Tensor)}
    assert before["val_loss"] > 5.0 and before["val_exact_match"] == 0.0, before
    assert after["val_loss"] < 1.6, after  # measured 1.33: the answer format and part of the digits
    assert after["val_token_accuracy"] > 0.4, after  # measured 0.51 (0.06 untrained)
    assert 0.0 <= after["val_exact_match"] <= 1.0  # the chat rows reach the exact-match metric
