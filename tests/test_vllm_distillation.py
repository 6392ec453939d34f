"""On-policy distillation sampling the student's completions with vLLM (``rollout_engine="vllm"``, in the training
process): every optimizer step's weights reach vLLM before the next sample, and what cannot work is refused."""

from __future__ import annotations

import pytest
import torch
from test_distillation import _dm, _fit

from helpers.models import tiny_llama
from helpers.vllm_env import vllm_python
from lit_trainer.models import load_tokenizer
from lit_trainer.modules.distillation import DistillationModule


def _module(**options) -> DistillationModule:
    student = tiny_llama(seed=0, hidden=64, layers=2, heads=2, intermediate=128)  # a head size vLLM's CPU kernels take
    teacher = tiny_llama(seed=1, hidden=32)  # the teacher stays in the trainer: any size
    options = {"max_new_tokens": 6, "temperature": 1.0, "learning_rate": 1e-2, "generation_seed": 0, **options}
    return DistillationModule(student, teacher_model=teacher, tokenizer=load_tokenizer("tiny"), **options)


@pytest.mark.slow
def test_the_students_completions_come_from_vllm_with_each_steps_weights():
    module = _module(lmbda=1.0, rollout_engine="vllm", rollout_engine_options={"python": vllm_python(), "threads": 1})
    start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    record = _fit(module, _dm(module.tokenizer), accumulate=1, steps=3)
    engine = module.rollouts.engine
    assert engine.reloads == 2  # before the samples of steps 2 and 3: each after an optimizer step
    assert engine.server is None  # stopped when fitting ended
    sampled = [int((rows["labels"] != -100).sum()) for rows in record.rows]
    assert len(sampled) == 3 and min(sampled) >= 4  # every micro-batch trained on sampled completions
    assert any(not torch.equal(p.detach(), start[n]) for n, p in module.model.named_parameters())


def test_vllm_with_seq_kd_or_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="seq_kd"):
        _module(rollout_engine="vllm", seq_kd=True)
    with pytest.raises(ValueError, match="'generate' or 'vllm'"):
        _module(rollout_engine="sglang")
    with pytest.raises(ValueError, match="without rollout_engine"):
        _module(rollout_engine_options={"threads": 1})
