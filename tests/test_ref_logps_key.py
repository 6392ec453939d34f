"""The DPO reference log-prob cache is keyed on everything that changes the log-probs, and written atomically."""

from __future__ import annotations

import copy

import pytest
import torch
from test_dpo_module import BETA, datamodule, trainer
from transformers import LlamaForCausalLM

from helpers.models import tiny_llama
from lit_trainer.modules.dpo import DPOModule
from lit_trainer.modules.reference import _ref_logps


def _same_weights_other_config(model: LlamaForCausalLM, **changes) -> LlamaForCausalLM:
    config = copy.deepcopy(model.config)
    for name, value in changes.items():
        setattr(config, name, value)
    other = LlamaForCausalLM(config)
    other.load_state_dict(model.state_dict())
    return other


def test_reference_fingerprint_covers_config_attention_and_precision():
    model = tiny_llama(0)
    key = _ref_logps.reference_sha256(model, "32-true")
    assert _ref_logps.reference_sha256(copy.deepcopy(model), "32-true") == key  # same everything: a cache hit
    rope = _same_weights_other_config(model, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    assert not torch.allclose(model(ids).logits, rope(ids).logits)  # the weights alone do not fix the log-probs
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert _ref_logps.state_dict_sha256(rope) == _ref_logps.state_dict_sha256(model)
    others = [
        _ref_logps.reference_sha256(rope, "32-true"),
        _ref_logps.reference_sha256(eager, "32-true"),
        _ref_logps.reference_sha256(model, "bf16-mixed"),
        _ref_logps.reference_sha256(model.to(torch.float64), "32-true"),
    ]
    assert len({key, *others}) == 5


def test_a_reference_with_another_config_recomputes(tokenizer, tmp_path, monkeypatch):
    def run(model: torch.nn.Module) -> None:
        module = DPOModule(
            model, learning_rate=1e-3, beta=BETA, precompute_ref_log_probs=True, ref_logps_cache_dir=str(tmp_path)
        )
        trainer(1).fit(module, datamodule=datamodule(tokenizer))

    model = tiny_llama(0)
    run(copy.deepcopy(model))
    assert len(list(tmp_path.glob("ref_logps-*.safetensors"))) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial file left behind
    monkeypatch.setattr(_ref_logps, "score_pairs", lambda *a, **k: pytest.fail("recomputed despite the cache"))
    run(copy.deepcopy(model))  # same weights and config: served from the cache
    monkeypatch.undo()
    run(_same_weights_other_config(model, rope_parameters={"rope_type": "default", "rope_theta": 100.0}))
    assert len(list(tmp_path.glob("ref_logps-*.safetensors"))) == 2
