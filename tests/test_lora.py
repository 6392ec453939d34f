"""LoRA (peft) fine-tuning: config forms, SFT from a trained export (exact match rises, base bit-identical), adapter
and merged exports (same logits as the module), adapter-only checkpoints with bit-exact resume (ExactResume +
JITCheckpoint), gradient checkpointing (same gradients).

The SFT run memorises a 64-problem subset of the built-in addition task (scored on those problems) so that a few
dozen steps move exact match on these 2-core machines; the base is a tiny preset SFT-trained for 50 steps.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import peft
import pytest
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer import CausalLMModule
from lit_trainer.callbacks import BestCheckpoint, ExactResume, HFExport, JITCheckpoint
from lit_trainer.data import SFTDataModule
from lit_trainer.data.builtin import sft_rows
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.modules.base import _adapter_checkpoint, _peft

LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
ROWS = sft_rows("train").select(range(64))
TRAINER = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "accelerator": "cpu",
    "devices": 1,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def sft_data(rows: Dataset = ROWS, **kw: Any) -> SFTDataModule:
    kw = {"max_length": 16, "batch_size": 64, "eval_batch_size": 256, **kw}
    return SFTDataModule(tokenizer="tiny", dataset=rows, validation_dataset=rows, **kw)


def exact_match(module: CausalLMModule) -> float:
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    return trainer.validate(module, sft_data(), verbose=False)[0]["val_exact_match"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 50-step full SFT export, then 50 LoRA steps on it with HFExport (adapter, merged) and BestCheckpoint."""
    root = tmp_path_factory.mktemp("lora")
    pl.seed_everything(0)
    base = CausalLMModule("tiny-64", learning_rate=3e-3, eval_exact_match=True, eval_max_new_tokens=4)
    pl.Trainer(max_steps=50, enable_checkpointing=False, callbacks=[HFExport(str(root / "base"))], **TRAINER).fit(
        base, sft_data()
    )
    pl.seed_everything(0)
    module = CausalLMModule(
        str(root / "base"), peft_config=LORA, learning_rate=1e-2, eval_exact_match=True, eval_max_new_tokens=4
    )
    before = exact_match(module)
    best = BestCheckpoint(
        dirpath=str(root / "ckpt"), monitor="train_loss", every_n_train_steps=50, export_hf=True, load_best_at_end=True
    )  # loads the adapter-only checkpoint back (non-strict)
    best_merged = BestCheckpoint(
        dirpath=str(root / "ckpt_merged"),
        monitor="loss",
        every_n_train_steps=50,
        export_hf=True,
        merge_adapters=True,
        mode="min",
    )  # another monitor: own state key
    callbacks = [
        HFExport(str(root / "adapter")),
        HFExport(str(root / "merged"), merge_adapters=True),
        best,
        best_merged,
    ]
    pl.Trainer(max_steps=50, log_every_n_steps=10, callbacks=callbacks, **TRAINER).fit(module, sft_data())
    return {"root": root, "module": module, "before": before, "after": exact_match(module), "best": best}


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_peft_config_forms_and_errors() -> None:
    module = CausalLMModule(tiny_llama(), peft_config={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert isinstance(module.model, peft.PeftModel) and module.model.peft_config["default"].r == 4
    assert module.model.peft_config["default"].task_type == "CAUSAL_LM"  # the default we set
    assert module.hparams["peft_config"] == {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    typed = CausalLMModule(tiny_llama(), peft_config=peft.LoraConfig(r=2, target_modules="all-linear"))
    assert typed.hparams["peft_config"]["r"] == 2 and typed.hparams["peft_config"]["peft_type"] == "LORA"
    other = CausalLMModule(
        tiny_llama(),
        peft_config={"peft_type": "IA3", "target_modules": ["down_proj"], "feedforward_modules": ["down_proj"]},
    )
    assert isinstance(other.model.peft_config["default"], peft.IA3Config)
    with pytest.raises(ValueError, match="rank.*keyword arguments of peft.LoraConfig"):
        CausalLMModule(tiny_llama(), peft_config={"rank": 4})
    with pytest.raises(ValueError, match="exclusive"):
        CausalLMModule(tiny_llama(), peft_config=LORA, adapter_path="somewhere")
    with pytest.raises(TypeError, match="peft.PeftConfig"):
        CausalLMModule(tiny_llama(), peft_config=[4])
    named = dict(typed.trainable_parameters())
    assert named and all(".lora_" in n for n in named)  # only adapters reach the optimizer
    with pytest.raises(ValueError, match="FSDPStrategy is not supported.*strategy='ddp'"):
        _peft.check_strategy(type("FSDPStrategy", (), {})())
    with pytest.raises(ValueError, match="Linear does not support gradient checkpointing"):
        _peft.enable_gradient_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_lora_sft_raises_exact_match_and_changes_only_adapters(lora_run: dict[str, Any]) -> None:
    assert lora_run["after"] >= lora_run["before"] + 0.05, (lora_run["before"], lora_run["after"])
    module = lora_run["module"]
    assert module.parameter_counts == (
        sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        sum(p.numel() for p in module.model.parameters()),
    )
    base = load_file(str(lora_run["root"] / "base" / "model.safetensors"))
    live = {
        n.replace(".base_layer", ""): p for n, p in module.model.get_base_model().named_parameters() if "lora_" not in n
    }
    assert base.keys() == live.keys() and not any(p.requires_grad for p in live.values())
    for name, tensor in base.items():
        assert torch.equal(live[name], tensor), name  # the base weights are bit-identical after training


def test_adapter_and_merged_exports_give_the_module_logits(lora_run: dict[str, Any]) -> None:
    root, module = lora_run["root"], lora_run["module"]
    ids = torch.tensor([[4, 55, 50, 58, 53, 64, 55], [60, 61, 46, 52, 57, 64, 3]])
    expected = _logits(module.model.eval(), ids)
    module.model.train()
    for adapter_dir in (root / "adapter", root / "ckpt" / "best"):
        assert not (adapter_dir / "model.safetensors").exists() and (adapter_dir / "adapter_config.json").exists()
        base = AutoModelForCausalLM.from_pretrained(str(root / "base"))
        loaded = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        torch.testing.assert_close(_logits(loaded, ids), expected, rtol=1e-5, atol=1e-5)
        assert AutoTokenizer.from_pretrained(str(adapter_dir)).encode("1+2=") == module.tokenizer.encode("1+2=")
    for merged_dir in (root / "merged", root / "ckpt_merged" / "best"):
        assert not (merged_dir / "adapter_config.json").exists()
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
        torch.testing.assert_close(_logits(merged, ids), expected, rtol=1e-4, atol=1e-4)
        assert AutoTokenizer.from_pretrained(str(merged_dir)).encode("1+2=") == module.tokenizer.encode("1+2=")


def test_lora_checkpoint_holds_only_the_adapter_and_refuses_another_base(lora_run: dict[str, Any]) -> None:
    path = lora_run["best"].best_model_path
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["state_dict"] and all(".lora_" in k for k in checkpoint["state_dict"])
    assert checkpoint["hyper_parameters"]["peft_config"] == LORA
    other = CausalLMModule("tiny-64", peft_config=LORA)  # same layout, other (random) base weights
    other_state = {k: v.clone() for k, v in checkpoint["state_dict"].items()}
    with pytest.raises(ValueError, match="frozen base weights of this module differ"):
        other.on_load_checkpoint({**checkpoint, "state_dict": other_state})
    wider = CausalLMModule("tiny-64", peft_config={**LORA, "r": 4})
    with pytest.raises(ValueError, match="no values for trainable parameters"):
        wider.on_load_checkpoint({"state_dict": {}})
    assert _adapter_checkpoint.FINGERPRINT_KEY in checkpoint


class _SignalSelf(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _resume_run(tmp_path: Path, callbacks: list, ckpt_path: str | None = None) -> CausalLMModule:
    pl.seed_everything(7)
    module = CausalLMModule(tiny_llama(seed=3), peft_config={**LORA, "lora_dropout": 0.1}, learning_rate=1e-2)
    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        enable_checkpointing=False,
        callbacks=[ExactResume(), *callbacks],
        default_root_dir=tmp_path,
        **TRAINER,
    )
    trainer.fit(module, sft_data(ROWS.select(range(32)), batch_size=4), ckpt_path=ckpt_path)
    return module


@pytest.mark.slow
def test_lora_resume_is_bit_exact(tmp_path: Path) -> None:
    reference = _resume_run(tmp_path / "a", [])
    jit = JITCheckpoint(kill_wait=0, dirpath=str(tmp_path / "jit"), exit_code=None)
    _resume_run(tmp_path / "b", [jit, _SignalSelf(3)])
    saved = torch.load(jit.checkpoint_path, weights_only=True)
    assert saved["global_step"] == 2 and all(".lora_" in k for k in saved["state_dict"])
    resumed = _resume_run(tmp_path / "c", [], ckpt_path=jit.checkpoint_path)
    expected, got = dict(reference.trainable_parameters()), dict(resumed.trainable_parameters())
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n], got[n]) for n in expected)


@pytest.mark.parametrize("peft_config", [None, LORA], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_gradients(peft_config: dict | None) -> None:
    batch = {"input_ids": torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(0))}
    batch["attention_mask"], batch["labels"] = torch.ones_like(batch["input_ids"]), batch["input_ids"].clone()
    grads = []
    # without, with checkpointing, and without in float64: the rounding scale of this gradient (helpers/rounding.py)
    for checkpointing, dtype in ((False, torch.float32), (True, torch.float32), (False, torch.float64)):
        module = CausalLMModule(
            tiny_llama(seed=5, layers=2), peft_config=peft_config, gradient_checkpointing=checkpointing
        )
        network = module.model
        if peft_config:  # a non-zero adapter, so the LoRA A matrices get gradients too
            torch.manual_seed(1)
            for name, param in module.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.1)
            network = module.model.get_base_model()
        assert network.model.layers[0].gradient_checkpointing is checkpointing
        module.to(dtype).compute_loss(dict(batch), None)[0].backward()
        grads.append({n: p.grad for n, p in module.trainable_parameters()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    # a real mistake: a checkpoint that cut the graph, leaving the first layer without gradient
    cut = {n: torch.zeros_like(g) if ".layers.0." in n else g for n, g in grads[0].items()}
    rounding = Rounding.of(grads[0], grads[2], what="gradient")
    rounding.check(grads[1], grads[0], mistake=relative_l2(cut, grads[0]))


@pytest.mark.parametrize("recipe", ["sft_lora", "dpo_lora", "sft_qlora"])
def test_lora_recipes_wrap_the_model_from_the_yaml_mapping(
    recipe: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lit_trainer.cli import LitTrainerCLI

    monkeypatch.chdir(tmp_path)
    base = tmp_path / "runs" / "sft" / "version_0" / "hf_model"  # where the recipes find the main job's export
    load_model("tiny").save_pretrained(base)
    load_tokenizer("tiny").save_pretrained(base)
    config = Path(__file__).resolve().parents[1] / "configs" / f"{recipe}.yaml"
    cli = LitTrainerCLI(args=["--config", str(config), "--trainer.logger=false"], run=False)
    assert isinstance(cli.model.model, peft.PeftModel) and cli.model.model.peft_config["default"].r == 16
    assert all(".lora_" in n for n, _ in cli.model.trainable_parameters())
