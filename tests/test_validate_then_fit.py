"""``trainer.validate()`` before ``trainer.fit()`` on the same module (a baseline score, then training)."""

import lightning.pytorch as pl
from datasets import Dataset

from helpers.models import tiny_llama
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.modules.causal_lm import CausalLMModule

TEXTS = ["ab", "longer row of text", "xyz", "mid row", "q", "another long row!", "hi", "row 8"]


def test_validate_then_fit_then_validate(tokenizer):
    dm = SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS}),
        validation_dataset=Dataset.from_dict({"text": TEXTS[:4]}),
        batch_size=2,
        eval_batch_size=2,
        max_length=64,
        sampling="sequential",
    )
    module = CausalLMModule(tiny_llama(seed=0), tokenizer=tokenizer, learning_rate=1e-2)
    trainer = pl.Trainer(
        max_steps=3,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = trainer.validate(module, datamodule=dm, verbose=False)[0]["val_loss"]
    trainer.fit(module, datamodule=dm)  # its validation updates the metrics that validate() reset
    during = float(trainer.callback_metrics["val_loss"])
    after = trainer.validate(module, datamodule=dm, verbose=False)[0]["val_loss"]
    assert during == after  # the same weights scored twice, the metric states were fresh both times
    assert after < before  # three steps at lr 1e-2 on the same rows lower the loss
