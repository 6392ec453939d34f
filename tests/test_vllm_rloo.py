"""RLOO sampled by vLLM in the training process (``RLOOModule(rollout_engine="vllm")``), as a user runs it from the
command line: every round's vLLM log-probs are checked against the trainer's and correct the loss, every optimizer
step's weights reach vLLM, and a resumed run's new server starts from the resumed weights.

The bound on the sampler check is tests/test_vllm_engine.py's (float32 rounding between vLLM's kernels and the
trainer's: 6e-6 measured); a weight that did not reach vLLM shows as 0.07 or more after one step at this learning rate
(tests/test_vllm_grpo.py). Two fits, each starting a vLLM server (about 11 s on 2 CPU cores).
"""

from __future__ import annotations

import pytest

from helpers.cli import fit_recipe, logged_rows
from helpers.ddp import script_env
from helpers.vllm_env import vllm_python
from lit_trainer.generation.vllm import PYTHON_ENV

pytestmark = pytest.mark.slow

ROUNDING = 1e-4  # tests/test_vllm_engine.py


def even_tokens(prompts: list, completions: list, completion_ids: list, **columns: object) -> list[float]:
    """Even token ids among the kept ones: varies within a group, so the policy moves every step (from scratch the
    recipe's arithmetic reward is 0 for every completion, and nothing would train)."""
    return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


def test_rloo_with_vllm_from_the_command_line_is_checked_corrected_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, vllm_python())
    monkeypatch.setenv("PYTHONPATH", script_env()["PYTHONPATH"])  # this file's reward, by import path
    options = [
        f"--model.init_args.reward_funcs=[{__name__}.even_tokens]",
        "--trainer.accumulate_grad_batches=1", "--data.init_args.batch_size=16", "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0", "--model.init_args.num_generations=4", "--model.init_args.learning_rate=0.01",
        "--model.init_args.beta=0.04",  # the KL reward: the trainer scores every row, so the check covers them all
        "--model.init_args.rollout_engine=vllm",
        "--model.init_args.rollout_engine_options={max_model_len: 64, threads: 1}",
    ]  # fmt: skip
    fit_recipe("rloo.yaml", tmp_path, "--trainer.max_steps=2", *options)
    fit_recipe("rloo.yaml", tmp_path, "--trainer.max_steps=3", "--ckpt_path=last", *options)
    # a finished run continued with a larger max_steps is a new version that starts from its last checkpoint
    rows = logged_rows(tmp_path / "runs" / "rloo" / "version_1")
    assert [int(r["step"]) for r in rows if r.get("sampler_check/logp_gap_max")] == [0, 1, 2]
    gaps = _column(rows, "sampler_check/logp_gap_max")
    # rounds 2 and 3 were sampled after an optimizer step (round 3 by the resumed run's new server)
    assert len(gaps) == 3 and max(gaps) < ROUNDING, gaps
    assert max(gaps) > 0  # two computations compared (vLLM's kernels and the trainer's), not one with itself
    ratios = _column(rows, "sampling/importance_sampling_ratio/mean")
    assert len(ratios) == 3 and all(abs(r - 1) < 1e-3 for r in ratios), ratios  # corrected, by about 1
    kl = _column(rows, "kl")
    assert len(kl) == 3 and kl[0] == 0 and min(abs(v) for v in kl[1:]) > 0  # the policy moved every step
