"""GRPO with tools, environments and ``rollout_func``: parsing and running tool calls, the batched multi-turn loop,
the tool mask through the buffer and the token normaliser, environments, a custom rollout function, exact resume.

The comparison with TRL 1.16's ``GRPOTrainer`` on the same conversations is in ``test_grpo_tools_trl.py``.
"""

from __future__ import annotations

import json
import logging
import operator
from typing import Any

import lightning as L
import pytest
import torch
from datasets import Dataset

from helpers.tool_policy import ScriptedGenerate, add, call
from lit_trainer.data import PromptDataModule, builtin
from lit_trainer.generation.agentic.environments import Environments
from lit_trainer.generation.agentic.multi_turn import multi_turn_rollouts
from lit_trainer.generation.agentic.tools import (
    ToolStats,
    parse_assistant_turn,
    parse_tool_calls,
    resolve_tools,
    run_tool_turns,
    tool_suffix_ids,
)
from lit_trainer.models import build_preset_model, build_tokenizer
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.rewards import arithmetic_reward

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
QUIET = {
    "accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
    "enable_checkpointing": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
}  # fmt: skip
PROBLEMS = [(1234, 4321), (5555, 1111), (2000, 3000), (4444, 4444)]


def render(tokenizer: Any, messages: list, **options: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options))


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError(f"boom {x}")


# ------------------------------------------------------------------------------------------------ tool calls
def test_tool_calls_parse_with_the_presets_response_template_and_the_fallback():
    tokenizer = build_tokenizer()
    text = call({"a": 1, "b": 2})
    expected = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    prefix = render(tokenizer, [{"role": "user", "content": "1+2=?"}], add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert parse_assistant_turn(tokenizer, ids, prefix, [add])["tool_calls"] == expected
    assert parse_tool_calls(text.removesuffix("</s>")) == ("", expected)
    tokenizer.response_template = None  # a tokenizer without a parser: the documented syntax, read here
    assert parse_assistant_turn(tokenizer, ids, prefix, [add])["tool_calls"] == expected
    for broken in ('<tool_call>{"name": "add", "argum</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', "42"):
        message = parse_assistant_turn(tokenizer, tokenizer(broken)["input_ids"], prefix, [add])
        assert "tool_calls" not in message and message["content"] == broken  # plain text: no call


def test_a_failing_or_unknown_tool_is_an_error_result_and_counted_never_a_crash():
    stats = ToolStats(per_row=[0])
    calls = [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"type": "function", "function": {"name": "boom", "arguments": {"x": 7}}},
        {"type": "function", "function": {"name": "nope", "arguments": {}}},
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
    ]
    (results,) = run_tool_turns([(calls, {"add": add, "boom": boom})], stats, [0])
    assert [m["content"] for m in results[:2]] == ["5", str({"error": "boom 7"})]
    assert "not found" in results[2]["content"] and "missing 1 required" in results[3]["content"]
    assert (stats.calls, stats.failures, stats.per_row) == (4, 3, [4])
    assert [m["role"] for m in results] == ["tool"] * 4 and [m["name"] for m in results][:2] == ["add", "boom"]


def test_tools_resolve_from_import_paths_and_errors_name_the_fix():
    assert resolve_tools(["lit_trainer.data.builtin.add"]) == [builtin.add]
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_tools(["no_such.module.add"])
    with pytest.raises(ValueError, match="unique"):
        resolve_tools([add, builtin.add])
    with pytest.raises(ValueError, match="`reward_funcs` is empty"):
        GRPOModule("tiny-64", reward_funcs=[], tools=[add])  # only an environment's get_reward may stand in
    with pytest.raises(ValueError, match=r"max_tool_calling_iterations=-1"):
        GRPOModule("tiny-64", reward_funcs=[arithmetic_reward], tools=[add], max_tool_calling_iterations=-1)


# ------------------------------------------------------------------------------------------- multi-turn loop
class FakeGenerate:
    """A batched ``generate`` stand-in: a call for a user turn, the result after a tool turn; records batch sizes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.batches = tokenizer, []

    def __call__(self, inputs: list[list[int]], budget: int) -> list[list[int]]:
        self.batches.append(len(inputs))
        out = []
        for ids in inputs:
            text = self.tokenizer.decode(ids)
            if text.endswith("<|tool|>\n" + text.rsplit("<|tool|>\n", 1)[-1]) and "<|tool|>" in text:
                reply = text.rsplit("<|tool|>\n", 1)[-1].split("\n")[0] + "</s>"
            else:
                a, b = (int(x) for x in text.rsplit("<|user|>\n", 1)[-1].split("=")[0].split("+"))
                reply = call({"a": a, "b": b}) if a % 2 == 0 else f"{a + b}</s>"
            out.append(self.tokenizer(reply, add_special_tokens=False)["input_ids"][:budget])
        return out


def test_multi_turn_sequences_are_the_chat_template_rendering_and_the_mask_skips_tool_results():
    tokenizer = build_tokenizer()
    questions = [(1234, 4321), (1111, 2), (2000, 3000)]  # odd a answers directly, even a calls the tool
    conversations = [[{"role": "user", "content": f"{a}+{b}=?"}] for a, b in questions]
    prompts = [render(tokenizer, c, tools=[add], add_generation_prompt=True) for c in conversations]
    generate = FakeGenerate(tokenizer)
    out = multi_turn_rollouts(
        generate, tokenizer, prompts, [{"add": add}] * 3, max_completion_length=200, max_iterations=3,
        eos_ids=[1], pad_token_id=0,
    )  # fmt: skip
    assert generate.batches == [3, 2]  # the first turn of all rows, then the two calling rows together
    assert (out.stats.calls, out.stats.failures) == (2, 0)
    for i, (conversation, (a, b)) in enumerate(zip(conversations, questions)):
        kept = out.attention_mask[i].bool()
        full = prompts[i] + out.completion_ids[i][kept].tolist()
        messages = conversation + out.messages[i]
        # the whole conversation rendered in one go by the chat template: the same tokens
        assert full == render(tokenizer, messages, tools=[add])
        model_text = tokenizer.decode(out.completion_ids[i][out.completion_mask[i].bool()])
        if a % 2 == 0:
            assert [m["role"] for m in out.messages[i]] == ["assistant", "tool", "assistant"]
            assert model_text == call({"a": a, "b": b}) + f"{a + b}</s>"  # the tool turn is not the model's
            tool_tokens = tool_suffix_ids(tokenizer, [out.messages[i][1]])
            assert int((out.completion_mask[i] == 0)[kept].sum()) == len(tool_tokens)
        else:
            assert out.messages[i] == [{"role": "assistant", "content": str(a + b)}]
            assert torch.equal(out.completion_mask[i], out.attention_mask[i])
    assert not out.truncated.any()


def test_max_iterations_and_the_completion_budget_bound_the_loop():
    tokenizer = build_tokenizer()

    def always_call(inputs: list[list[int]], budget: int) -> list[list[int]]:
        return [tokenizer(call({"a": 2, "b": 2}), add_special_tokens=False)["input_ids"][:budget] for _ in inputs]

    prompt = [render(tokenizer, [{"role": "user", "content": "2+2=?"}], add_generation_prompt=True)]
    one = multi_turn_rollouts(
        always_call, tokenizer, prompt, [{"add": add}], max_completion_length=500, max_iterations=2, eos_ids=[1],
        pad_token_id=0,
    )  # fmt: skip
    assert one.stats.calls == 2 and [m["role"] for m in one.messages[0]].count("assistant") == 3
    none = multi_turn_rollouts(
        always_call, tokenizer, prompt, [{"add": add}], max_completion_length=500, max_iterations=0, eos_ids=[1],
        pad_token_id=0,
    )  # fmt: skip
    assert none.stats.calls == 0 and len(none.messages[0]) == 1  # the call is made but never run
    call_length = len(tokenizer(call({"a": 2, "b": 2}), add_special_tokens=False)["input_ids"])
    tight = multi_turn_rollouts(
        always_call, tokenizer, prompt, [{"add": add}], max_completion_length=call_length + 5, max_iterations=5,
        eos_ids=[1], pad_token_id=0,
    )  # fmt: skip
    # the tool result does not fit: it is dropped and the row ends with its calling turn (no tool message)
    assert [m["role"] for m in tight.messages[0]] == ["assistant"] and tight.completion_mask.sum() == call_length


# ------------------------------------------------------------------------------------------------ the module
def prompt_rows(problems=PROBLEMS, **columns: list) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}=?"}] for a, b in problems],
            "answer": [str(a + b) for a, b in problems],
            **columns,
        }
    )


def module(**kwargs: Any) -> GRPOModule:
    torch.manual_seed(0)
    options = {
        "reward_funcs": [arithmetic_reward], "num_generations": 3, "max_completion_length": 160,
        "learning_rate": 1e-3, "scheduler": "constant", "max_grad_norm": 0.0, "generation_seed": 0, **kwargs,
    }  # fmt: skip
    grpo = GRPOModule(build_preset_model("tiny-64"), tokenizer=build_tokenizer(), **options)
    grpo.scripted = ScriptedGenerate(grpo.model, grpo.tokenizer)
    return grpo


def data(rows: Dataset, batch_size: int = 6) -> PromptDataModule:
    return PromptDataModule(
        tokenizer=build_tokenizer(), dataset=rows, batch_size=batch_size, max_length=64, val_size=0,
        sampling="sequential",
    )  # fmt: skip


class Rounds(L.Callback):
    """Records each round's buffered slices and metrics at its first micro-step, and the weights at the end."""

    def __init__(self) -> None:
        self.rounds: list[tuple[list[dict], dict]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int):
        if pl_module._buffer.served == 1:
            self.rounds.append(([dict(s) for s in pl_module._buffer.slices], dict(pl_module._buffer.metrics)))


def test_tool_rounds_buffer_the_tool_mask_and_the_normaliser_counts_model_tokens_only():
    grpo, rounds = module(tools=[add], steps_per_generation=2), Rounds()
    L.Trainer(max_steps=2, callbacks=[rounds], **QUIET).fit(grpo, datamodule=data(prompt_rows(), batch_size=6))
    slices, metrics = rounds.rounds[0]
    assert grpo.scripted.calls == [12, 8]  # 4 prompts x 3 rollouts, then the 8 calling rows in one batch
    # per prompt: a correct call, a direct answer, a failing call -> 2 calls per 3 rollouts, half of them failing
    assert float(metrics["tools/call_frequency"]) == pytest.approx(2 / 3)
    assert float(metrics["tools/failure_frequency"]) == pytest.approx(0.5)
    assert float(metrics["reward"]) == pytest.approx(1 / 3)
    tool_tokens = 0
    for piece in slices:
        attention, loss_mask = piece["completion_attention_mask"], piece["completion_mask"]
        assert bool((loss_mask <= attention).all())
        tool_tokens += int((attention - loss_mask).sum())
    assert tool_tokens > 0
    model_tokens = torch.stack([s["completion_mask"].sum() for s in slices]).float()
    assert torch.equal(grpo._buffer.slice_tokens, model_tokens)  # dapo's normaliser: the model's tokens only
    lengths = [int(s["completion_mask"].sum(1).max()) for s in slices]
    assert float(metrics["completions/max_length"]) == max(lengths)  # lengths count the model's tokens


def test_tool_result_tokens_get_no_gradient():
    """Changing a tool result's tokens changes the context but not which tokens are trained: the gradient of the loss
    w.r.t. the logits at tool-result positions is zero."""
    grpo = module(tools=[add])
    L.Trainer(max_steps=1, **QUIET).fit(grpo, datamodule=data(prompt_rows(PROBLEMS[:2])))
    rows = grpo._buffer.slices[0]
    captured = {}

    def keep_logits(_module: Any, _inputs: Any, output: Any) -> None:
        output.logits.retain_grad()
        captured["logits"] = output.logits

    handle = grpo.model.register_forward_hook(keep_logits)
    loss, _ = grpo.compute_loss(rows, None)
    handle.remove()
    loss.backward()
    width = rows["completion_ids"].shape[1]
    grad = captured["logits"].grad[:, -width - 1 : -1].abs().sum(-1)  # position t predicts completion token t
    tool = (rows["completion_attention_mask"] - rows["completion_mask"]).bool()
    assert tool.any() and float(grad[tool].max()) == 0.0 and float(grad[rows["completion_mask"].bool()].max()) > 0


class CountingEnv:
    """Counts its tool calls; rewards a call with the right sum. Defined here, not as a subclass of the helpers'
    ``AddEnv``: a failing call's error result names the method's class, and its length decides whether the result
    fits the completion budget, which the async twin below must match."""

    def reset(self, **row: Any) -> str:
        self.answer, self.result = int(row["answer"]), None
        return " Use add."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        self.result = a + b
        return a + b

    def get_reward(self) -> float:
        return 1.0 if self.result == self.answer else 0.0


class Silent(CountingEnv):
    def reset(self, **row: Any) -> None:
        self.answer, self.result = int(row["answer"]), None

    def get_reward(self) -> float:
        return 0.5


def test_environments_one_per_rollout_reset_tools_and_get_reward():
    envs = Environments({"counting": CountingEnv, "silent": Silent})
    assert envs.reward_names == ["CountingEnv", "Silent"]
    columns = {"environment": ["counting", "silent", "counting"], "answer": ["3", "4", "5"]}
    instances = envs.assign(columns, 3)
    assert [type(e) for e in instances] == [CountingEnv, Silent, CountingEnv] and instances[0] is not instances[2]
    prompts = envs.reset(instances, [[{"role": "user", "content": "q"}]] * 3, columns)
    assert [p[-1]["content"] for p in prompts] == ["q Use add.", "q", "q Use add."]
    owned = GRPOModule("tiny-64", reward_funcs=[], environment_factory=CountingEnv)  # the environment owns the reward
    assert owned.reward_names == ["CountingEnv"] and owned.tools == []
    with pytest.raises(ValueError, match="not a key of environment_factory"):
        envs.assign({"environment": ["other"]}, 1)
    with pytest.raises(ValueError, match="needs an 'environment' column"):
        envs.assign({}, 1)
    with pytest.raises(ValueError, match="has no `reset` method"):
        Environments(dict)


def test_a_dict_of_environments_scores_with_get_reward_under_each_class_name():
    rows = prompt_rows(PROBLEMS[:2], environment=["counting", "silent"])
    factories = {"counting": CountingEnv, "silent": Silent}
    grpo, rounds = module(environment_factory=factories, reward_weights=[1.0]), Rounds()
    L.Trainer(max_steps=1, callbacks=[rounds], **QUIET).fit(grpo, datamodule=data(rows))
    metrics = rounds.rounds[0][1]
    assert grpo.reward_names == ["arithmetic_reward", "CountingEnv", "Silent"] and grpo.reward_weights == [1.0] * 3
    assert float(metrics["rewards/CountingEnv/mean"]) == pytest.approx(1 / 3)  # one correct call in 3 rollouts
    assert float(metrics["rewards/Silent/mean"]) == pytest.approx(0.5)  # its own rollouts only
    assert grpo.hparams["environment_factory"] == {"counting": "CountingEnv", "silent": "Silent"}


def scripted_rollout(prompts: list, module: GRPOModule) -> dict[str, list]:
    """A ``rollout_func``: the answer plus EOS, then two 'environment' tokens masked out with ``env_mask``."""
    tokenizer = module.tokenizer
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "source": []}
    for k, prompt in enumerate(prompts):
        a, b = (int(x) for x in prompt[-1]["content"].split("=")[0].split("+"))
        answer = tokenizer(f"{a + b + k % 2}</s>", add_special_tokens=False)["input_ids"]
        extra = tokenizer("!!", add_special_tokens=False)["input_ids"]
        out["prompt_ids"].append(render(tokenizer, prompt, add_generation_prompt=True))
        out["completion_ids"].append(answer + extra)
        out["logprobs"].append([0.0] * (len(answer) + len(extra)))
        out["env_mask"].append([1] * len(answer) + [0] * len(extra))
        out["source"].append(f"row{k}")
    return out


def test_rollout_func_replaces_generation_and_forwards_extra_fields_to_the_rewards():
    seen: list = []

    def reward(completions: list, answer: list, source: list, **_: Any) -> list[float]:
        seen.extend(source)
        return arithmetic_reward([], completions, [], answer=answer)

    grpo, rounds = module(reward_funcs=[reward], rollout_func=scripted_rollout), Rounds()
    L.Trainer(max_steps=1, callbacks=[rounds], **QUIET).fit(grpo, datamodule=data(prompt_rows(PROBLEMS[:2])))
    assert grpo.scripted.calls == [] and seen == [f"row{k}" for k in range(6)]
    slices, metrics = rounds.rounds[0]
    piece = slices[0]
    assert int((piece["completion_attention_mask"] - piece["completion_mask"]).sum()) == 2 * 6  # env_mask zeros
    assert float(metrics["reward"]) == pytest.approx(0.0)  # "5555!!" is not "5555": the env tokens are text too
    with pytest.raises(ValueError, match=r"must return the keys \['logprobs'\]"):
        bad = module(rollout_func=lambda p, m: {"prompt_ids": [], "completion_ids": []})
        L.Trainer(max_steps=1, **QUIET).fit(bad, datamodule=data(prompt_rows(PROBLEMS[:2])))


def test_resume_inside_a_tool_round_is_exact_and_does_not_rerun_tools(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(ckpt_path: str | None, callbacks: list) -> GRPOModule:
        grpo = module(tools=[add], steps_per_generation=4)
        options = {**QUIET, "enable_checkpointing": bool(callbacks)}
        L.Trainer(max_steps=6, callbacks=callbacks, default_root_dir=tmp_path, **options).fit(
            grpo, datamodule=data(prompt_rows(), batch_size=3), ckpt_path=ckpt_path
        )
        return grpo

    full = fit(None, [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    resumed = fit(str(tmp_path / "epoch=0-step=2.ckpt"), [])
    assert len(full.scripted.calls) == 4  # two rounds, each a first turn and one tool turn
    assert resumed.scripted.calls == full.scripted.calls[2:]  # the interrupted round came back from the checkpoint
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


PYTHON_ARITHMETIC = {"+": operator.add, "*": operator.mul}  # the reference for the built-in tasks' answers


@pytest.mark.parametrize(
    ("chat_rows", "prompt_rows_of", "tool", "symbol"),
    [
        (builtin.tool_addition_chat_rows, builtin.tool_addition_prompt_rows, builtin.add, "+"),
        (builtin.tool_multiplication_chat_rows, builtin.tool_multiplication_prompt_rows, builtin.multiply, "*"),
    ],
    ids=["addition", "multiplication"],
)
def test_builtin_tool_task_rows_render_with_the_tool_schema(chat_rows, prompt_rows_of, tool, symbol):
    chat = chat_rows("train")
    calls = [m for m in chat["messages"] if len(m) == 4]
    assert len(calls) == -(-len(chat) // 2) and json.loads(chat["tools"][0])[0]["function"]["name"] == tool.__name__
    call_turn = calls[0][1]["tool_calls"][0]["function"]
    a, b = (int(x) for x in calls[0][0]["content"].removesuffix("=?").split(symbol))
    assert call_turn["arguments"] == {"a": a, "b": b} and call_turn["name"] == tool.__name__
    assert tool(**call_turn["arguments"]) == int(calls[0][2]["content"]) == int(calls[0][3]["content"])
    direct = next(m for m in chat["messages"] if len(m) == 2)
    a, b = (int(x) for x in direct[0]["content"].removesuffix("=?").split(symbol))
    assert direct[1]["content"] == str(PYTHON_ARITHMETIC[symbol](a, b))
    prompts = prompt_rows_of("validation")
    held_out = {p[0]["content"] for p in prompts["prompt"]}
    assert not held_out & {m[0]["content"] for m in chat["messages"]}
    first = prompts[0]
    a, b = (int(x) for x in first["prompt"][0]["content"].removesuffix("=?").split(symbol))
    assert first["answer"] == str(PYTHON_ARITHMETIC[symbol](a, b))


def test_max_tool_calling_iterations_zero_runs_no_tool():
    grpo, rounds = module(tools=[add], max_tool_calling_iterations=0), Rounds()
    L.Trainer(max_steps=1, callbacks=[rounds], **QUIET).fit(grpo, datamodule=data(prompt_rows(PROBLEMS[:2])))
    assert grpo.scripted.calls == [6] and float(rounds.rounds[0][1]["tools/call_frequency"]) == 0.0


# ------------------------------------------------------------------------------------------------------ async
class InFlight:
    """Counts the coroutines waiting at once: > 1 only when they are awaited together, not one after another."""

    def __init__(self) -> None:
        self.now = self.most = 0

    async def wait(self) -> None:
        import asyncio

        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.05)  # every coroutine of a batch starts before the first finishes
        self.now -= 1


def test_async_tools_of_all_rows_are_awaited_together_in_call_order_and_their_errors_are_results():
    flight = InFlight()

    async def slow_add(a: int, b: int) -> int:
        """Add, slowly.

        Args:
            a: first
            b: second
        """
        await flight.wait()
        if a < 0:
            raise ValueError("negative")
        return a + b

    def turn(*calls: tuple[str, dict]) -> list[dict]:
        return [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]

    tools = {"add": add, "slow_add": slow_add}
    stats = ToolStats(per_row=[0, 0, 0])
    turns = [
        (turn(("slow_add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})), tools),
        (turn(("slow_add", {"a": -1, "b": 2})), tools),
        (turn(("slow_add", {"a": 10, "b": 20}), ("slow_add", {"a": 5})), tools),  # the last misses an argument
    ]
    results = run_tool_turns(turns, stats, [0, 1, 2])
    contents = [[m["content"] for m in row] for row in results]
    assert contents == [["3", "7"], [str({"error": "negative"})], ["30", contents[2][1]]]  # in call order
    assert "missing 1 required" in contents[2][1]
    assert flight.most == 3  # the three awaited calls of the three rows overlapped
    assert (stats.calls, stats.failures, stats.per_row) == (5, 2, [2, 1, 2])


def test_async_reward_functions_are_awaited_together_and_a_failure_names_the_function():
    from lit_trainer.rewards import RewardFunctionError, call_reward_functions

    flight = InFlight()

    async def judge(completions: list, **_: Any) -> list[float]:
        await flight.wait()
        return [float(len(c)) for c in completions]

    async def strict(completions: list, **_: Any) -> list[float]:
        await flight.wait()
        return [1.0 if c == "82" else 0.0 for c in completions]

    def broken_async(completions: list, **_: Any) -> Any:
        async def fail() -> list[float]:
            raise KeyError("judge down")

        return fail()

    table = call_reward_functions([judge, arithmetic_reward, strict], ["37+45="] * 2, ["82", "9"], [[], []],
                                  {"answer": ["82", "82"]})  # fmt: skip
    assert table.tolist() == [[2.0, 1.0, 1.0], [1.0, 0.0, 0.0]] and flight.most == 2
    with pytest.raises(RewardFunctionError, match="`broken_async` raised KeyError"):
        call_reward_functions([broken_async], ["1+1="], ["2"], [[]])


def test_async_code_runs_when_the_caller_is_inside_an_event_loop_as_in_a_notebook():
    import asyncio

    from lit_trainer.rewards import call_reward_functions

    async def reward(completions: list, **_: Any) -> list[float]:
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    async def notebook_cell() -> Any:  # Jupyter runs cells inside its own running loop
        return call_reward_functions([reward], ["p"], ["c"], [[]])

    assert asyncio.run(notebook_cell()).tolist() == [[1.0]]


class AsyncCountingEnv:
    """:class:`CountingEnv` with ``async def`` reset, tool and get_reward."""

    async def reset(self, **row: Any) -> str:
        self.answer, self.result = int(row["answer"]), None
        return " Use add."

    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        self.result = a + b
        return a + b

    async def get_reward(self) -> float:
        return 1.0 if self.result == self.answer else 0.0


def test_an_async_environment_trains_exactly_as_its_sync_twin():
    runs = []
    for factory in (CountingEnv, AsyncCountingEnv):
        grpo, rounds = module(environment_factory=factory), Rounds()
        L.Trainer(max_steps=1, callbacks=[rounds], **QUIET).fit(grpo, datamodule=data(prompt_rows(PROBLEMS[:2])))
        runs.append((grpo, rounds.rounds[0]))
    (sync, (sync_slices, sync_metrics)), (coro, (coro_slices, coro_metrics)) = runs
    assert coro.reward_names == ["arithmetic_reward", "AsyncCountingEnv"] and coro.tools == []
    assert float(coro_metrics["rewards/AsyncCountingEnv/mean"]) == pytest.approx(1 / 3)  # one correct call in 3
    assert float(coro_metrics["tools/call_frequency"]) == float(sync_metrics["tools/call_frequency"]) > 0
    for a, b in zip(sync_slices, coro_slices):  # the reset hint, the tool results, the advantages: all the same
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for (name, a), (_, b) in zip(sync.state_dict().items(), coro.state_dict().items()):
        assert torch.equal(a, b), name


def test_tool_rounds_run_on_continuous_batching_with_the_same_rows_as_generate():
    """With ``use_transformers_continuous_batching`` every turn goes through ``generate_batch`` (unpadded prompt +
    completion so far); the scripted engine replies as the scripted ``generate`` does, so the buffered rows match."""
    from helpers.tool_policy import ScriptedGenerateBatch

    rows = []
    for options in ({}, {"use_transformers_continuous_batching": True}):
        grpo, rounds = module(tools=[add], **options), Rounds()
        engine = ScriptedGenerateBatch(grpo.model, grpo.tokenizer)
        L.Trainer(max_steps=1, callbacks=[rounds], **QUIET).fit(grpo, datamodule=data(prompt_rows(PROBLEMS[:2])))
        rows.append(rounds.rounds[0][0])
    assert grpo.scripted.calls == [] and [len(c) for c in engine.calls] == [6, 4]  # 4 of 6 rollouts call the tool
    assert all(0 not in ids for turn in engine.calls for ids in turn)  # no padding (id 0) reaches the engine
    second = [grpo.tokenizer.decode(ids) for ids in engine.calls[1]]
    assert all(text.endswith("<|assistant|>\n") and "<tool_call>" in text and "<|tool|>" in text for text in second)
    for a, b in zip(*rows):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
