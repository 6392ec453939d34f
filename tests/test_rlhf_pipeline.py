"""SFT -> reward model -> GRPO whose only reward is that model, through ``lit-trainer`` as a user runs the recipes.

The three recipes (configs/sft.yaml, reward.yaml, grpo_rm.yaml) run in one folder with a few steps each, on small
files cut from the built-in data (tokenizing the full built-in sets would dominate the test); each stage reads the
previous stage's export from the run folder the documented commands write (the SFT stage is the main job's run,
``runs/sft/``).
"""

from __future__ import annotations

import math

import pytest
from transformers import AutoModelForSequenceClassification

from helpers.cli import fit_recipe, logged_rows
from lit_trainer.data import builtin


@pytest.mark.slow
def test_sft_then_reward_model_then_grpo_on_it(tmp_path):
    builtin.sft_rows("train").select(range(64)).to_json(tmp_path / "sft.jsonl")
    builtin.preference_rows("train").select(range(64)).to_json(tmp_path / "pairs.jsonl")
    builtin.prompt_rows("train").select(range(32)).to_json(tmp_path / "prompts.jsonl")

    fit_recipe("sft.yaml", tmp_path, "--trainer.max_steps=4",
               "--data.init_args.batch_size=16", f"--data.init_args.dataset={tmp_path / 'sft.jsonl'}")  # fmt: skip
    fit_recipe("reward.yaml", tmp_path, "--trainer.max_steps=4", "--data.init_args.batch_size=16",
               f"--data.init_args.dataset={tmp_path / 'pairs.jsonl'}")  # fmt: skip
    reward_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "runs/reward/version_0/hf_model")
    assert reward_model.config.num_labels == 1
    # GRPO: 2 optimizer steps of 16 completions (2 prompts x 8) per micro-batch, 2 micro-batches per step
    fit_recipe("grpo_rm.yaml", tmp_path, "--trainer.max_steps=2", "--data.init_args.batch_size=16",
               f"--data.init_args.dataset={tmp_path / 'prompts.jsonl'}", "--trainer.limit_val_batches=1",
               "--data.init_args.eval_batch_size=4")  # fmt: skip

    run = tmp_path / "runs" / "grpo_rm" / "version_0"
    logged = logged_rows(run)
    rows = [r for r in logged if r.get("reward")]
    before = [r for r in logged if r.get("val_rewards/reward/mean")]
    assert before and before[0]["step"] == "0"  # EvalOnStart: the starting policy's reward-model score
    assert len(rows) == 2  # one logged row per optimizer step
    for row in rows:
        # the reward model (named after its run, 'reward') is the only reward: arithmetic_reward has weight 0
        assert math.isclose(float(row["reward"]), float(row["rewards/reward/mean"]), rel_tol=1e-6, abs_tol=1e-6)
        assert 0.0 <= float(row["rewards/arithmetic_reward/mean"]) <= 1.0  # the monitor is logged beside it
    assert (run / "hf_model" / "config.json").exists()
