"""The public rollout generator (:class:`lit_trainer.generation.RolloutGenerator`): its sampling config comes from
its options, its engine is the plug-in point and samples on the round's seeded RNG, and GRPO samples through it."""

from __future__ import annotations

import torch
import transformers
from test_grpo_module import length_reward

from helpers.models import tiny_llama
from lit_trainer.generation import GenerateEngine, RolloutEngine, RolloutGenerator, SamplingOptions
from lit_trainer.modules.grpo import GRPOModule

OPTIONS = SamplingOptions(
    max_completion_length=5, temperature=0.7, top_p=0.9, top_k=3, min_p=None, repetition_penalty=1.1
)


class RecordingEngine(RolloutEngine):
    """A plug-in engine: records the config it gets and one draw of the global RNG, then samples with ``generate``."""

    def __init__(self) -> None:
        self.configs, self.draws = [], []

    def generate(self, model, prompt_ids, prompt_mask, config, eos_ids, *, synced=False, should_stop=None):
        self.configs.append(config)
        self.draws.append(torch.rand(1))
        return GenerateEngine().generate(model, prompt_ids, prompt_mask, config, eos_ids)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    enc = transformers.ByT5Tokenizer()(["10+11=", "7+8="], padding=True, padding_side="left", add_special_tokens=False)
    return torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"])


def test_a_plug_in_engine_samples_with_the_options_on_the_seeded_rng_and_leaves_the_global_rng_alone():
    model, (ids, mask), engine = tiny_llama(0, eos_bias=3.0), _prompts(), RecordingEngine()
    rollouts = RolloutGenerator(engine, OPTIONS, transformers.ByT5Tokenizer())
    eos = rollouts.eos_token_ids(model)
    config = rollouts.sampling_config(model, eos)
    assert (config.max_new_tokens, config.temperature, config.top_p, config.top_k) == (5, 0.7, 0.9, 3)
    assert config.repetition_penalty == 1.1 and config.do_sample
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = rollouts.generate(model, ids, mask, config, eos, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)  # the training stream is where it was
    again = rollouts.generate(model, ids, mask, config, eos, seed=7)
    assert engine.configs == [config, config]
    assert torch.equal(engine.draws[0], torch.rand(1, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(first.ids, again.ids) and torch.equal(first.mask, again.mask)


def test_grpo_holds_a_rollout_generator_with_its_engine_and_sampling_options():
    module = GRPOModule(
        tiny_llama(0), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward], num_generations=2,
        max_completion_length=6, temperature=0.5, top_k=4,
    )  # fmt: skip
    assert isinstance(module.rollouts, RolloutGenerator) and module.rollouts.engine is module.engine
    assert module.rollouts.options.max_completion_length == 6
    assert (module.rollouts.options.temperature, module.rollouts.options.top_k) == (0.5, 4)


def test_the_generator_runs_a_tool_round_and_masks_the_tool_result_out_of_the_loss():
    """A tools round of the generator alone (no module): a tiny preset policy whose ``generate`` is scripted
    (``helpers.tool_policy``: the first row calls ``add(2, 3)`` then answers the result, the second answers ``6``
    directly). The loss mask, checked by hand: 1 on the tool call, 0 on the tool message, 1 on the answer; all 1 on
    the direct answer."""
    from helpers.tool_policy import ScriptedGenerate, add, call
    from lit_trainer.data.prompt import PROMPTS, REWARD_COLUMNS
    from lit_trainer.models import build_preset_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_preset_model("tiny-64")
    ScriptedGenerate(model, tokenizer)
    options = SamplingOptions(
        max_completion_length=200, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0
    )
    rollouts = RolloutGenerator(GenerateEngine(), options, tokenizer)
    eos = rollouts.eos_token_ids(model)
    question = [{"role": "user", "content": "2+3=?"}]
    batch = {PROMPTS: [question, question], REWARD_COLUMNS: {}}
    out = rollouts.tool_round(
        model, batch, rollouts.sampling_config(model, eos), eos, tools=[add], environments=None,
        chat_template_kwargs=None, max_tool_calling_iterations=3, device=torch.device("cpu"),
    )  # fmt: skip

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    called, answer, direct = tokens(call({"a": 2, "b": 3})), tokens("5</s>"), tokens("6</s>")
    ids, loss, attention = (
        out.rows["completion_ids"],
        out.rows["completion_mask"],
        out.rows["completion_attention_mask"],
    )
    length = int(attention[0].sum())
    tool = length - len(called) - len(answer)  # the tool message and the next assistant header
    assert tool > 0
    assert loss[0, :length].tolist() == [1] * len(called) + [0] * tool + [1] * len(answer)
    assert ids[0, : len(called)].tolist() == called and ids[0, length - len(answer) : length].tolist() == answer
    assert "5" in tokenizer.decode(ids[0, len(called) : len(called) + tool])  # the tool's result, not the model's
    assert loss[1].tolist() == attention[1].tolist() == [1] * len(direct) + [0] * (ids.shape[1] - len(direct))
    assert ids[1, : len(direct)].tolist() == direct
    assert [m["role"] for m in out.texts[0]] == ["assistant", "tool", "assistant"]
    assert out.tool_metrics["tools/call_frequency"].item() == 0.5  # one call over two rows
