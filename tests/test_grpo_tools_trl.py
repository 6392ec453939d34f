"""Tool-calling GRPO against TRL 1.16's ``GRPOTrainer`` (``tools=`` and ``environment_factory=``) on the same
conversations and completions.

A scripted policy (:mod:`helpers.tool_policy`) replaces ``generate`` on both sides, so both run the same turns: a
correct tool call, a direct (wrong) answer, and a call the tool rejects. Everything after generation is each side's
own code: parsing the calls, running the tools or the environments, appending the tool messages' tokens, the tool mask,
the rewards (a reward function and an environment's ``get_reward``), advantages, the dapo loss and its gradient on the
same initial weights. The comparisons: the multi-turn token ids of every rollout, its tool mask, its rewards and
advantage, the loss and the gradients.

TRL runs at ``bf16=False`` (its default, ``bf16=True``, scores under bf16 autocast, also on the CPU: its gradient then
lies about 3e-3 (relative L2) from the float64 one, and a bound at that scale would pass a gradient error of about 1%).
In float32 TRL's gradient lies about 2.8e-7 from the same loss evaluated with the model in float64 (measured here,
every run: :class:`helpers.rounding.Rounding`) and ours about 3e-7 from TRL's float32 one; the bound is 4 times that
scale (about 1.1e-6). The scale is measured on the machine running the test, with its kernels, and two float32
evaluations in other orders each land about that far from the exact result, so they stay within 2 x the scale of each
other on any CPU. The loss's own float32-vs-float64 distance measured 0 here (one number can round exactly), so the
loss is held to the gradient's scale, the rounding of the same log-probs over many values: observed 1.8e-7 (3 float32
units), bound about 1.1e-6. The real mistake this test exists for, training on the tool-result tokens, moves the
gradient by about 0.8, over 10^5 bounds.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from typing import Any

import lightning as L
import pytest
import torch
from datasets import Dataset

from helpers import tool_policy
from helpers.rounding import Rounding, relative_l2, values
from helpers.tool_policy import ScriptedGenerate, add
from lit_trainer.data import PromptDataModule
from lit_trainer.models import build_preset_model, build_tokenizer
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.rewards import arithmetic_reward

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
PROBLEMS = [(1234, 4321), (5555, 1111)]
G = 3  # generations per prompt: the scripted policy's three behaviours
MAX_COMPLETION = 160


class AddEnv(tool_policy.AddEnv):
    """An environment: ``add`` is its tool, ``reset`` appends a hint, ``get_reward`` rewards a correct call."""

    hint = " Use the tool."


def prompt_rows() -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}=?"}] for a, b in PROBLEMS],
            "answer": [str(a + b) for a, b in PROBLEMS],
        }
    )


def initial_model() -> Any:
    torch.manual_seed(0)
    model = build_preset_model("tiny-64")
    model.config.max_position_embeddings = 1024  # TRL drops tool results that reach it; the prompts hold the schema
    return model


def agentic(mode: str) -> dict[str, Any]:
    return {"tools": [add]} if mode == "tools" else {"environment_factory": AddEnv}


def trl_round(
    tmp_path: Any, mode: str, choose: Any = tool_policy.reply, budget: int = MAX_COMPLETION
) -> tuple[Any, Any, dict[str, Any]]:
    """TRL: ``(trainer, initial model, output)`` of one generation batch, generated, with tools, and scored."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, model = build_tokenizer(), initial_model()
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), report_to="none", per_device_train_batch_size=len(PROBLEMS) * G,
        num_generations=G, use_cpu=True, max_completion_length=budget, loss_type="dapo", beta=0.0, bf16=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=[arithmetic_reward], args=args, train_dataset=prompt_rows(),
        processing_class=tokenizer, **agentic(mode),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which is not run here
    ScriptedGenerate(trainer.model, tokenizer, choose)
    rows = prompt_rows()
    inputs = [{"prompt": p, "answer": a} for p, a in zip(rows["prompt"], rows["answer"]) for _ in range(G)]
    return trainer, model, trainer._generate_and_score_completions(inputs)


def reference(tmp_path: Any, mode: str) -> dict[str, Any]:
    """TRL: one generation batch scored, its loss and gradient (float32), and the float64 loss/gradient."""
    trainer, model, out = trl_round(tmp_path, mode)
    result = {"out": out, "rewards": {k: list(v) for k, v in trainer._logs["rewards"].items()}}
    for dtype in (torch.float32, torch.float64):
        policy = copy.deepcopy(model).to(dtype)
        loss = trainer.compute_loss(policy, out)
        loss.backward()
        result[dtype] = (loss.detach(), {n: p.grad.detach().float() for n, p in policy.named_parameters()})
    policy = copy.deepcopy(model)
    wrong = {**out, "tool_mask": torch.ones_like(out["tool_mask"])}  # the mistake: tool results trained on
    trainer.compute_loss(policy, wrong).backward()
    result["tool_tokens_trained"] = {n: p.grad.detach() for n, p in policy.named_parameters()}
    return result


class FirstStep(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss = outputs["loss"].detach()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}
        self.slice = dict(pl_module._buffer.slices[0])
        self.table = pl_module.completion_table


def ours(mode: str, choose: Any = tool_policy.reply, budget: int = MAX_COMPLETION) -> FirstStep:
    """One optimizer step of GRPOModule (its first round's rows, loss and gradient)."""
    tokenizer = build_tokenizer()
    module = GRPOModule(
        initial_model(), tokenizer=tokenizer, reward_funcs=[arithmetic_reward], num_generations=G,
        max_completion_length=budget, loss_type="dapo", beta=0.0, learning_rate=1e-3, max_grad_norm=0.0,
        scheduler="constant", generation_seed=0, log_completions=True, num_completions_to_print=1, **agentic(mode),
    )  # fmt: skip
    ScriptedGenerate(module.model, tokenizer, choose)
    data = PromptDataModule(
        tokenizer=tokenizer, dataset=prompt_rows(), batch_size=len(PROBLEMS) * G, max_length=64, val_size=0,
        sampling="sequential",
    )  # fmt: skip
    step = FirstStep()
    L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[step],
    ).fit(module, datamodule=data)  # fmt: skip
    return step


def by_sequence(prompt_ids, prompt_mask, completion_ids, attention, loss_mask, advantages) -> dict[tuple, tuple]:
    """``{full token ids: (loss mask over the completion, advantage)}`` of each rollout (no padding)."""
    rows = {}
    for i in range(prompt_ids.shape[0]):
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        kept = attention[i].bool()
        key = tuple(prompt + completion_ids[i][kept].tolist())
        rows[key] = (loss_mask[i][kept].tolist(), float(advantages[i]))
    return rows


@pytest.mark.slow  # importing trl and building its trainer takes several seconds
@pytest.mark.parametrize("mode", ["tools", "environment"])
def test_multi_turn_rollouts_rewards_loss_and_gradients_equal_trl(tmp_path, mode):
    expected, got = reference(tmp_path, mode), ours(mode)
    out = expected["out"]
    theirs = by_sequence(
        out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"],
        out["completion_mask"] * out["tool_mask"], out["advantages"],
    )  # fmt: skip
    s = got.slice
    mine = by_sequence(
        s["prompt_ids"], s["prompt_mask"], s["completion_ids"], s["completion_attention_mask"], s["completion_mask"],
        s["advantages"],
    )  # fmt: skip
    assert len(theirs) == len(PROBLEMS) * G  # every rollout distinct: a row mix-up cannot hide
    assert mine.keys() == theirs.keys()  # the same multi-turn token ids: prompt with tools, calls, tool results
    for key, (mask, advantage) in theirs.items():
        assert mine[key][0] == mask  # the tool mask: 0 exactly on the tool messages' tokens
        assert mine[key][1] == pytest.approx(advantage, abs=1e-6)  # float32 mean/std of the same rewards
    assert sum(m.count(0) for m, _ in theirs.values()) > 0 and len({a for _, a in theirs.values()}) > 1

    columns, table = got.table
    for name, reference_rewards in expected["rewards"].items():
        # rewards in rollout order on both sides (the table is in generation order, before the buffer's shuffle)
        column = [row[columns.index(name)] for row in table]
        assert column == pytest.approx(reference_rewards, nan_ok=True), name
    assert ("AddEnv" in expected["rewards"]) == (mode == "environment")

    (loss32, grads32), (loss64, grads64) = expected[torch.float32], expected[torch.float64]
    gradient = Rounding.of(grads32, grads64, what="gradient")
    gradient.check(got.grads, grads32, mistake=relative_l2(expected["tool_tokens_trained"], grads32))
    own = Rounding.of(values([float(loss32)]), values([float(loss64)])).scale  # may be 0: see the module docstring
    loss = Rounding(max(own, gradient.scale), what="loss")
    loss.check(values([float(got.loss)]), values([float(loss32)]), mistake=abs(float(loss32)))


def failing_calls(context: str, occurrence: int) -> str:
    """First turns whose calls fail before any tool runs: an unknown tool, arguments that are a list, arguments that
    are a JSON string (by the prompt's occurrence); after the error, :func:`helpers.tool_policy.reply`."""
    if context.split("<|")[-2].startswith("tool|>"):
        return tool_policy.reply(context, occurrence)
    a, b = (int(x) for x in re.search(r"(\d+)\+(\d+)=\?", context).groups())
    calls = [
        {"name": "subtract", "arguments": {"a": a, "b": b}},
        {"name": "add", "arguments": [a, b]},
        {"name": "add", "arguments": json.dumps({"a": a, "b": b})},
    ]
    return "<tool_call>" + json.dumps(calls[occurrence % 3]) + "</tool_call></s>"


@pytest.mark.slow  # importing trl and building its trainer takes several seconds
@pytest.mark.parametrize("mode", ["tools", "environment"])
def test_failed_calls_put_trls_error_text_in_the_rollouts(tmp_path, mode):
    """The model reads the error of an unknown tool or of non-object arguments: the same tokens as under TRL."""
    budget = 400  # room for the longest error text: a result that does not fit is dropped (both sides)
    _, _, out = trl_round(tmp_path, mode, failing_calls, budget)
    theirs = by_sequence(
        out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"],
        out["completion_mask"] * out["tool_mask"], out["advantages"],
    )  # fmt: skip
    s = ours(mode, failing_calls, budget).slice
    mine = by_sequence(
        s["prompt_ids"], s["prompt_mask"], s["completion_ids"], s["completion_attention_mask"], s["completion_mask"],
        s["advantages"],
    )  # fmt: skip
    tokenizer = build_tokenizer()
    texts = sorted(tokenizer.decode(list(key)) for key in theirs)
    assert sum("error" in t for t in texts) == len(PROBLEMS) * G  # every rollout read an error
    assert sorted(tokenizer.decode(list(key)) for key in mine) == texts  # the texts first: a readable difference
    assert mine.keys() == theirs.keys() and all(mine[k][0] == theirs[k][0] for k in theirs)
