"""What a user meets around a rollout engine before and after its rounds (found by trying RLOO with vLLM cold):
refusals before training starts, a server and its weights released when a fit fails or a start fails, messages that
name the option, and metrics that say nothing rather than something false.

No vLLM server starts here: a server that cannot start (this environment's Python has no vLLM) fails within seconds;
the other cases use stand-in engines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from test_grpo_module import QUIET, data, grpo, length_reward, tiny_model

from helpers.models import tiny_llama
from helpers.vllm_env import vllm_python
from lit_trainer.generation import engines
from lit_trainer.generation.engines import GenerateEngine
from lit_trainer.generation.vllm import VLLMEngine
from lit_trainer.modules.online_rl._sampler import SamplerCheck
from lit_trainer.modules.rloo import RLOOModule

CLOSED: list[str] = []


class ClosingEngine(GenerateEngine):
    """``generate`` that records when it is closed (as a server-holding engine would stop its server)."""

    def close(self) -> None:
        CLOSED.append("closed")


def failing_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    raise RuntimeError("the reward service is down")


@pytest.mark.parametrize("module_class", ["GRPOModule", "RLOOModule"])
def test_a_fit_that_fails_closes_the_modules_engine(module_class):
    """Lightning calls no module hook on an exception: without the callback a vLLM server kept running (and its
    weights stayed in /dev/shm) until the interpreter exited."""
    CLOSED.clear()
    options = {"rollout_engine": f"{__name__}.ClosingEngine", "reward_funcs": [failing_reward]}
    if module_class == "GRPOModule":
        module = grpo(**options)
    else:
        module = RLOOModule(tiny_model(), tokenizer=transformers.ByT5Tokenizer(), num_generations=4, beta=0.0,
                            max_completion_length=4, **options)  # fmt: skip
    with pytest.raises(RuntimeError, match="reward service is down"):
        L.Trainer(max_steps=2, **QUIET).fit(module, datamodule=data(n=8, batch_size=8))
    assert CLOSED  # by the callback's on_exception (teardown is not called on an exception)


def test_an_engine_that_holds_nothing_adds_no_callback():
    assert grpo().configure_callbacks() == []
    callbacks = grpo(rollout_engine=f"{__name__}.ClosingEngine").configure_callbacks()
    assert [type(c) for c in callbacks] == [engines.CloseEngines]


def test_a_vllm_server_that_cannot_start_leaves_no_weights_in_shared_memory():
    """This environment's interpreter has no vLLM: the server exits at once, and the engine removes the checkpoint it
    had written for it; the message names the install command."""
    engine = VLLMEngine(python=sys.executable, threads=1)
    prompts = torch.tensor([[5, 6, 7]])
    config = engines.sampling_config(0, [1], max_completion_length=2, temperature=1.0, top_p=1.0, top_k=0,
                                     min_p=None, repetition_penalty=1.0)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"exited with code[\s\S]*lit_trainer.generation.vllm install"):
        engine.generate(tiny_llama(0), prompts, torch.ones_like(prompts), config, [1])
    assert not list(Path("/dev/shm").glob(f"lit-vllm-{os.getpid()}-*"))
    assert engine.server is None


def test_a_vllm_start_interrupted_by_ctrl_c_kills_the_server(monkeypatch):
    """Ctrl-C while the server starts (simulated: the first wait of the start raises KeyboardInterrupt) kills it: left
    starting, it would load the model and then wait forever for a connection, holding its KV cache."""
    from lit_trainer.generation import vllm as vllm_module

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    engine = VLLMEngine(python=vllm_python(), threads=1)
    prompts = torch.tensor([[5, 6, 7]])
    config = engines.sampling_config(0, [1], max_completion_length=2, temperature=1.0, top_p=1.0, top_k=0,
                                     min_p=None, repetition_penalty=1.0)  # fmt: skip
    monkeypatch.setattr(vllm_module.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(tiny_llama(0), prompts, torch.ones_like(prompts), config, [1])
    monkeypatch.undo()
    assert not _children_running("vllm_server") and not list(Path("/dev/shm").glob(f"lit-vllm-{os.getpid()}-*"))


def _children_running(name: str) -> list[int]:
    """Pids of this process's living children whose command line contains ``name`` (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # the process ended while read
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and name in cmdline:
            found.append(int(stat.parent.name))
    return found


def _rloo_vllm(**engine_options: Any) -> RLOOModule:
    return RLOOModule(
        tiny_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward], num_generations=4,
        max_completion_length=8, beta=0.0, rollout_engine="vllm", rollout_engine_options=engine_options,
    )  # fmt: skip


def test_vllm_problems_are_refused_at_setup_before_any_server_starts():
    # an interpreter that exists but has no vLLM (found by trying it: it failed only at the first round)
    with pytest.raises(FileNotFoundError, match=r"cannot import vllm.*lit_trainer.generation.vllm install"):
        L.Trainer(max_steps=1, **QUIET).fit(_rloo_vllm(python=sys.executable), datamodule=data(n=8, batch_size=8))
    # a max_model_len below the longest prompt + the completion budget: vLLM ended every completion early, silently
    module = _rloo_vllm(python=vllm_python(), max_model_len=8)
    with pytest.raises(ValueError, match=r"max_model_len=8 is below the longest prompt \(\d+ tokens\) \+ 8 new"):
        L.Trainer(max_steps=1, **QUIET).fit(module, datamodule=data(n=8, batch_size=8))
    assert module.engine.server is None


def test_option_messages_name_the_option_and_the_class():
    with pytest.raises(ValueError, match="'sglang' is not an engine: use one of \\['vllm'\\]"):
        RLOOModule("tiny", reward_funcs=[length_reward], rollout_engine="sglang")
    with pytest.raises(ValueError, match=r"mode='foo'\)` is invalid \(not a mode\)"):
        RLOOModule("tiny", reward_funcs=[length_reward], rollout_importance_sampling_mode="foo")
    with pytest.raises(TypeError, match="RLOOModule\\(\\) got GRPOModule's option\\(s\\) max_staleness"):
        RLOOModule("tiny", reward_funcs=[length_reward], max_staleness=1)
    with pytest.warns(UserWarning, match="sampler_check_threshold=0.5\\) has no effect without rollout_engine"):
        RLOOModule("tiny", reward_funcs=[length_reward], sampler_check_threshold=0.5)
    # VESPO needs a per-token correction, which every round of vLLM gets (in this process too: no max_staleness)
    with pytest.raises(ValueError, match="loss_type='vespo'.*rollout_engine='vllm'.*token_truncate"):
        grpo(loss_type="vespo", rollout_engine="vllm")
    grpo(loss_type="vespo", rollout_engine=f"{__name__}.ClosingEngine")  # the trainer's numerics: nothing corrected


def test_the_sampler_check_logs_nothing_when_nothing_was_compared():
    """Every completion masked (``mask_truncated_completions``, all truncated): a gap of 0 would read as perfect."""
    module = type("M", (), {"trainer": type("T", (), {"world_size": 1})()})()
    check = SamplerCheck(0.05, "VLLMEngine")
    mine, theirs = torch.zeros(2, 3), torch.ones(2, 3)
    assert check.measure(module, mine, theirs, torch.zeros(2, 3), "round 0") == {}
    measured = check.measure(module, mine, theirs, torch.tensor([[1, 0, 0], [0, 0, 0]]), "round 1")
    assert float(measured["sampler_check/logp_gap_mean"]) == 1.0 and check.warned
