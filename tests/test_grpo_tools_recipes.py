"""The tool recipes as a user runs them: chat SFT on tool-use transcripts (configs/sft_tool_chat.yaml), then GRPO
with the tool from that export (configs/grpo_tools.yaml), through ``lit-trainer``, a few steps each on small files cut
from the built-in tool task. The measured rise of tool use and reward (full recipes) is in docs/grpo_tools.md."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from helpers.cli import fit_recipe, logged_rows
from lit_trainer.data import builtin


@pytest.mark.slow
def test_tool_sft_then_grpo_with_the_tool_through_lit_trainer(tmp_path):
    builtin.tool_multiplication_chat_rows("train").select(range(32)).to_json(tmp_path / "chat.jsonl")
    builtin.tool_multiplication_prompt_rows("train").select(range(40)).to_json(tmp_path / "prompts.jsonl")
    fit_recipe("sft_tool_chat.yaml", tmp_path, "--trainer.max_steps=3", "--data.init_args.batch_size=8",
               f"--data.init_args.dataset={tmp_path / 'chat.jsonl'}")  # fmt: skip
    export = tmp_path / "runs" / "sft_tool_chat" / "version_0" / "hf_model"
    assert "tool_call" in AutoTokenizer.from_pretrained(export).chat_template  # renders tools and calls
    # GRPO from the export as documented: 2 steps of 2 prompts x 8 rollouts, greedy validation before and after
    fit_recipe("grpo_tools.yaml", tmp_path, "--model.init_args.model=runs/sft_tool_chat/version_0/hf_model",
               "--trainer.max_steps=2", "--data.init_args.batch_size=16",
               f"--data.init_args.dataset={tmp_path / 'prompts.jsonl'}",
               "--trainer.limit_val_batches=1", "--data.init_args.eval_batch_size=4", "--trainer.val_check_interval=2",
               "--model.init_args.max_completion_length=96")  # fmt: skip
    run = tmp_path / "runs" / "grpo_tools" / "version_0"
    logged = logged_rows(run)
    steps = [r for r in logged if r.get("reward")]
    validations = [r for r in logged if r.get("val_tools/call_frequency")]
    assert len(steps) == 2 and [r["step"] for r in validations][:1] == ["0"]  # EvalOnStart: the "before"
    for row in steps:
        calls, failures = float(row["tools/call_frequency"]), float(row["tools/failure_frequency"])
        assert calls >= 0.0 and 0.0 <= failures <= 1.0 and 0.0 <= float(row["reward"]) <= 1.0
    assert (run / "hf_model" / "config.json").exists()
