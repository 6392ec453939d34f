"""A vision-language run's HF export holds the processor too: ``AutoModelForImageTextToText`` and ``AutoProcessor``
reload it and generate from a picture and a prompt exactly as the trained model does; the recipe's CLI path too."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.cli import CONFIGS
from lit_trainer.callbacks import HFExport
from lit_trainer.callbacks.hf_export import saved_tokenizer
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.data import SFTDataModule
from lit_trainer.data.builtin_shapes import QUESTION, sft_rows
from lit_trainer.models import VISION_CHAT_TEMPLATE
from lit_trainer.modules.causal_lm import CausalLMModule

# no bar or summary; EvalOnStart (in the recipe) needs validation batches, so one small one instead of QUIET_FIT's none
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _inputs(processor, row) -> dict[str, torch.Tensor]:
    """A picture and the question as the chat template renders a prompt, processed for ``generate``."""
    image = Image.open(io.BytesIO(row["images"][0])).convert("RGB")
    prompt = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
    return dict(processor(text=prompt, images=image, return_tensors="pt"))


def test_export_reloads_with_the_auto_classes_and_generates_as_trained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rows = sft_rows("validation").select(range(12))
    module = CausalLMModule("tiny-vl", learning_rate=1e-2, warmup_steps=0)
    data = SFTDataModule(
        tokenizer="tiny-vl", dataset=rows, val_size=4, batch_size=4, max_length=64, assistant_only_loss=True
    )
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[HFExport(dirpath=str(tmp_path / "hf"))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    untrained = copy.deepcopy(module.model).eval()
    trainer.fit(module, data)
    export = tmp_path / "hf"
    # the processor's own files: image processor settings (+ the processor's), tokenizer, chat template
    assert {"processor_config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in export.iterdir()}
    processor = AutoProcessor.from_pretrained(export)
    model = AutoModelForImageTextToText.from_pretrained(export).eval()
    trained = module.model.eval()
    assert type(processor).__name__ == "LlavaProcessor" and processor.chat_template == VISION_CHAT_TEMPLATE
    assert processor.tokenizer.get_vocab() == data.processor.tokenizer.get_vocab()
    inputs = _inputs(processor, rows[0])
    assert processor.decode(inputs["input_ids"][0]).count("<image>") == 16  # the template's image part, expanded
    assert torch.equal(inputs["input_ids"], _inputs(data.processor, rows[0])["input_ids"])
    assert torch.equal(inputs["pixel_values"], _inputs(data.processor, rows[0])["pixel_values"])
    with torch.no_grad():
        logits = model(**inputs).logits
        assert torch.equal(logits, trained(**inputs).logits)
        assert not torch.allclose(logits, untrained(**inputs).logits, atol=1e-3)  # the 2 steps moved the weights
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert torch.equal(generated, trained.generate(**inputs, max_new_tokens=3, do_sample=False))
    assert generated.shape[1] > inputs["input_ids"].shape[1]
    assert QUESTION in processor.decode(generated[0])


def test_export_keeps_the_tokenizer_without_a_processor() -> None:
    """Text runs save the module's tokenizer as before; a processor comes from the data module, else the module."""
    tokenizer, processor, other = object(), SimpleNamespace(save_pretrained=print), SimpleNamespace(save_pretrained=id)
    module = SimpleNamespace(tokenizer=tokenizer)
    assert saved_tokenizer(SimpleNamespace(datamodule=None), module) is tokenizer
    assert saved_tokenizer(SimpleNamespace(datamodule=SimpleNamespace(processor=None)), module) is tokenizer
    assert saved_tokenizer(SimpleNamespace(datamodule=SimpleNamespace(processor=processor)), module) is processor
    module.processor = other
    assert saved_tokenizer(SimpleNamespace(datamodule=None), module) is other
    assert saved_tokenizer(SimpleNamespace(datamodule=SimpleNamespace(processor=processor)), module) is processor


@pytest.mark.slow
def test_sft_vl_recipe_through_the_cli_exports_a_processor(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    quick = ["--trainer.max_steps=1", "--trainer.limit_val_batches=1", "--data.init_args.eval_batch_size=4"]
    LitTrainerCLI(args=["fit", "--config", str(CONFIGS / "sft_vl.yaml"), *quick, *QUIET])
    export = tmp_path / "runs" / "sft_vl" / "version_0" / "hf_model"
    processor = AutoProcessor.from_pretrained(export)
    assert processor.chat_template == VISION_CHAT_TEMPLATE
    assert AutoModelForImageTextToText.from_pretrained(export).config.model_type == "llava"
