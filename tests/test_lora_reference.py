"""LoRA with a reference model: DPO/GRPO score the reference with the adapters disabled (no copy), equal to a frozen
full copy; a saved adapter's starting point as reference; precomputed reference log-probs; BEMA and NEFTune on
adapters."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import peft
import pytest
import torch

from helpers.models import tiny_llama
from lit_trainer import CausalLMModule, DPOModule, GRPOModule
from lit_trainer.callbacks import BEMA, NEFTune
from lit_trainer.callbacks.neftune import find_input_embedding
from lit_trainer.data import PromptDataModule, SFTDataModule, builtin
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.preference.collate import REF_CHOSEN_KEY
from lit_trainer.models import build_tokenizer
from lit_trainer.modules.base._peft import AdapterReference

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
TRAINER = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "accelerator": "cpu",
    "devices": 1,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def _pairs_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (4, 10), generator=gen)
    completion = torch.zeros_like(ids)
    completion[:, 5:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}


def _move_adapters(module: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero adapter weights, as after some training (the policy then differs from the base)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name and param.requires_grad:
                param.normal_(std=0.2)


def _flags(module: torch.nn.Module) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in module.named_parameters()}


def test_dpo_adapter_disabled_reference_equals_a_frozen_full_copy() -> None:
    batch = _pairs_batch()
    full = DPOModule(tiny_llama(seed=2))
    lora = DPOModule(tiny_llama(seed=2), peft_config=LORA)
    assert isinstance(lora.ref_model, AdapterReference)
    assert not any(n.startswith("ref_model") for n in lora.state_dict())  # no second copy of the weights
    held_full = sum(p.numel() for p in full.parameters())
    held_lora = sum(p.numel() for p in lora.parameters())
    assert held_lora < 0.6 * held_full, (held_lora, held_full)  # about half: one base instead of two
    _move_adapters(lora)
    flags = _flags(lora)
    policy = lora.score(lora.model, batch).seq
    reference = lora._reference_logps(batch)
    torch.testing.assert_close(reference, full._reference_logps(batch), rtol=1e-5, atol=1e-5)
    assert (policy - reference).abs().max() > 1e-2  # the adapters are on for the policy, off for the reference
    assert _flags(lora) == flags and lora.model.training  # nothing left switched


def test_a_saved_adapter_is_the_reference_and_stays_frozen(tmp_path: Path) -> None:
    start = peft.get_peft_model(tiny_llama(seed=4), peft.LoraConfig(**LORA, task_type="CAUSAL_LM"))
    _move_adapters(start, seed=5)
    start.save_pretrained(str(tmp_path / "adapter"))
    batch = _pairs_batch()
    module = DPOModule(tiny_llama(seed=4), adapter_path=str(tmp_path / "adapter"))
    assert sorted(module.model.peft_config) == ["default", "reference"]
    trainable = [n for n, _ in module.trainable_parameters()]
    assert trainable and all(".default." in n for n in trainable)
    expected = module.score(start.eval(), batch).seq.detach()
    torch.testing.assert_close(module.score(module.model, batch).seq.detach(), expected)  # policy starts there
    _move_adapters(module, seed=6)  # "training" moves the default adapter only
    flags = _flags(module)
    torch.testing.assert_close(module._reference_logps(batch), expected, rtol=1e-5, atol=1e-5)
    assert _flags(module) == flags and module.model.active_adapter == "default"
    with pytest.raises(ValueError, match="sync_ref_model=True.*adapters disabled"):
        DPOModule(tiny_llama(), peft_config=LORA, sync_ref_model=True)


def _preference_data() -> PreferenceDataModule:
    rows = builtin.preference_rows("train").select(range(16))
    return PreferenceDataModule(tokenizer="tiny", dataset=rows, val_size=0, max_length=16, batch_size=8)


@pytest.mark.slow
def test_dpo_lora_precomputed_reference_equals_the_full_copy() -> None:
    values = []
    for peft_config in (None, LORA):
        module = DPOModule(
            tiny_llama(seed=8), peft_config=peft_config, precompute_ref_log_probs=True, learning_rate=1e-2
        )
        data = _preference_data()
        pl.Trainer(max_steps=2, **TRAINER).fit(module, data)
        values.append(torch.tensor(data.split_dataset("train")[REF_CHOSEN_KEY]))
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=1e-5)
    assert isinstance(module.ref_model, AdapterReference)  # kept: it holds no weights, and scores new data


def _token_sum_reward(prompts: list, completions: list, completion_ids: list, **columns: object) -> list[float]:
    """An arbitrary reward that differs between completions (non-zero advantages)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


@pytest.mark.slow
def test_grpo_lora_rollouts_carry_the_base_model_reference_log_probs() -> None:
    module = GRPOModule(
        tiny_llama(seed=9),
        tokenizer=build_tokenizer(),
        peft_config=LORA,
        beta=0.04,
        reward_funcs=[_token_sum_reward],
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-2,
        generation_seed=0,
    )
    assert isinstance(module.ref_model, AdapterReference)
    data = PromptDataModule(
        tokenizer="tiny",
        dataset=builtin.prompt_rows("train").select(range(8)),
        val_size=0,
        batch_size=4,
        max_length=16,
        sampling="sequential",
    )
    pl.Trainer(max_steps=3, **TRAINER).fit(module, data)  # the adapters have moved before the last round
    base = tiny_llama(seed=9)
    rows = module._buffer.slices[0]
    torch.testing.assert_close(rows["ref_logps"], module.completion_logps(base, rows)[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        policy = module.completion_logps(module.model, rows)[0]
    assert (policy - rows["ref_logps"]).abs().max() > 1e-4  # the reference is not the trained policy


@pytest.mark.slow
def test_bema_averages_the_adapters_and_refuses_updating_a_shared_reference(tmp_path: Path) -> None:
    rows = builtin.sft_rows("train").select(range(16))
    data = SFTDataModule(tokenizer="tiny", dataset=rows, val_size=0, max_length=16, batch_size=8)
    bema = BEMA(update_freq=1, export_dir=str(tmp_path / "bema"))
    module = CausalLMModule(tiny_llama(seed=10), peft_config=LORA, learning_rate=1e-2)
    pl.Trainer(max_steps=3, callbacks=[bema], **TRAINER).fit(module, data)
    weights = bema.bema_state_dict()
    assert weights.keys() == dict(module.trainable_parameters()).keys()
    assert all(".lora_" in name for name in weights)
    exported = peft.PeftModel.from_pretrained(tiny_llama(seed=10), str(tmp_path / "bema"))
    key = next(iter(weights))
    # the BEMA adapter, saved and read back: exact
    torch.testing.assert_close(exported.get_parameter(key[len("model.") :]), weights[key], rtol=0, atol=0)
    dpo = DPOModule(tiny_llama(), peft_config=LORA)
    with pytest.raises(ValueError, match="adapters disabled"):
        pl.Trainer(max_steps=1, callbacks=[BEMA(update_ref_model=True)], **TRAINER).fit(dpo, _preference_data())


def test_neftune_finds_the_embedding_through_the_peft_wrapper() -> None:
    module = CausalLMModule(tiny_llama(seed=11), peft_config=LORA)
    embedding = find_input_embedding(module)
    assert embedding is module.model.get_base_model().model.embed_tokens
    neftune = NEFTune(noise_alpha=5.0, seed=0)
    ids = torch.randint(3, 300, (2, 6))
    clean = embedding(ids)
    neftune.attach(module)
    noisy = embedding(ids)
    neftune.detach()
    assert (noisy - clean).abs().max() > 0 and torch.equal(clean, embedding(ids))
