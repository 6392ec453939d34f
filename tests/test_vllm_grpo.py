"""GRPO sampling with vLLM (``rollout_engine="vllm"``) through the rollout worker, and in the training process without
one: every round is checked and corrected, the sync reaches vLLM after every optimizer step, and a resume neither
skips nor repeats a prompt.

Five fits, each starting its own vLLM server (about 11 s on 2 CPU cores). The bound on the sampler check is
tests/test_vllm_engine.py's (float32 rounding between vLLM's kernels and the trainer's: 6e-6 measured; a weight that
did not reach vLLM shows as 0.07 or more after one step at this learning rate, tests/test_grpo_async.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_grpo_module import QUIET, data, grpo

from helpers.cli import fit_recipe, logged_rows
from helpers.models import tiny_llama
from helpers.vllm_env import vllm_python
from lit_trainer.generation.vllm import PYTHON_ENV, VLLMEngine

pytestmark = pytest.mark.slow

ROUNDING = 1e-4  # tests/test_vllm_engine.py
PROMPT_LOG = "LIT_TEST_VLLM_PROMPT_LOG"


def recording_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    """Even token ids among the kept ones (varies within a group: completions rarely end early here); every scored
    round's prompts are appended to ``$LIT_TEST_VLLM_PROMPT_LOG``."""
    with open(os.environ[PROMPT_LOG], "a") as log:
        log.write(json.dumps(list(prompts)) + "\n")
    return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]


class NeverSyncs(VLLMEngine):
    """A broken engine: vLLM keeps the weights it started with (a sync that silently never happens)."""

    def sync(self, model: Any) -> None:
        if self.server is None:
            super().sync(model)


class WorkerPid(L.Callback):
    """Records the rollout worker's pid (the process that owns the vLLM engine and its folder in /dev/shm)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.server_log: Path | None = None  # the in-process engine's server log

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        worker = pl_module.async_rollouts.worker
        self.pid = worker.pid if worker is not None else os.getpid()  # a synchronous run: the engine is here
        server = getattr(pl_module.engine, "server", None)
        self.server_log = server.log_path if server is not None else self.server_log


def _fit(
    root: Path, steps: int, ckpt_path: str | None = None, every: int = 0, engine: str = "vllm", staleness: int = 1
) -> Any:
    L.seed_everything(0)
    worker = {"max_staleness": staleness, "rollout_worker_threads": 1} if staleness is not None else {}
    module = grpo(
        tiny_llama(0, hidden=64, layers=2, heads=2, intermediate=128),
        reward_funcs=[recording_reward],
        max_completion_length=6,
        rollout_engine=engine,
        rollout_engine_options={"python": vllm_python(), "max_model_len": 64, "threads": 1},
        **worker,
    )
    callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
    callbacks.append(pid := WorkerPid())
    trainer = L.Trainer(
        max_steps=steps, callbacks=callbacks, log_every_n_steps=1,
        **{**QUIET, "enable_checkpointing": bool(every), "logger": CSVLogger(root, name="log")},
    )  # fmt: skip
    trainer.fit(module, datamodule=data(n=16, batch_size=8), ckpt_path=ckpt_path)
    left = list(Path("/dev/shm").glob(f"lit-vllm-{pid.pid}-*"))
    assert not left, f"the engine's weights were left in shared memory: {left}"
    assert pid.server_log is None or not pid.server_log.exists(), "a server that stopped cleanly left its log"
    module.server_log = pid.server_log
    return module


def _log(root: Path) -> pd.DataFrame:
    return pd.concat(pd.read_csv(v / "metrics.csv") for v in sorted((root / "log").iterdir()))


def _prompts(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_vllm_rounds_are_checked_corrected_and_resume_without_a_lost_or_repeated_prompt(tmp_path, monkeypatch):
    whole_log = tmp_path / "whole.jsonl"
    monkeypatch.setenv(PROMPT_LOG, str(whole_log))
    start = {
        n: p.detach().clone()
        for n, p in tiny_llama(0, hidden=64, layers=2, heads=2, intermediate=128).named_parameters()
    }
    whole = _fit(tmp_path / "whole", 4)
    moved = [n for n, p in whole.model.named_parameters() if not torch.equal(p.detach(), start[n])]
    assert moved, "the policy did not train"
    log = _log(tmp_path / "whole")
    gaps = log["sampler_check/logp_gap_max"].dropna()
    assert len(gaps) == 4 and (gaps < ROUNDING).all(), gaps.tolist()  # vLLM had each round's weights
    assert (gaps > 0).any()  # another engine's kernels: the check compares two computations, not one with itself
    # every round is corrected (an engine with its own numerics), and rounds after the first are one step stale
    assert len(log["sampling/importance_sampling_ratio/mean"].dropna()) >= 4
    assert log["async/staleness"].dropna().tolist() == [0.0, 1.0, 1.0, 1.0]

    parts_log = tmp_path / "parts.jsonl"
    monkeypatch.setenv(PROMPT_LOG, str(parts_log))
    _fit(tmp_path / "parts", 2, every=2)
    _fit(tmp_path / "parts", 4, ckpt_path=str(tmp_path / "parts" / "ckpt" / "epoch=0-step=2.ckpt"))
    assert _prompts(parts_log) == _prompts(whole_log)  # each round's prompts once, in the same order
    assert len(_prompts(whole_log)) == 4


def test_synchronous_grpo_samples_with_vllm_in_the_training_process(tmp_path, monkeypatch):
    """No ``max_staleness``: no worker, the module's own engine samples; every round corrected and checked."""
    monkeypatch.setenv(PROMPT_LOG, str(tmp_path / "prompts.jsonl"))
    module = _fit(tmp_path, 3, staleness=None)
    log = _log(tmp_path)
    gaps = log["sampler_check/logp_gap_max"].dropna()
    assert len(gaps) == 3 and (gaps < ROUNDING).all(), gaps.tolist()
    assert len(log["sampling/importance_sampling_ratio/mean"].dropna()) >= 3
    assert "async/staleness" not in log
    assert module.engine.reloads == 2 and module.engine.server is None  # after steps 1 and 2; stopped at the end
    assert module.server_log is not None  # the server ran in this process (its log removed when it stopped)


def test_a_vllm_that_never_gets_the_new_weights_is_caught_by_the_sampler_check(tmp_path, monkeypatch):
    monkeypatch.setenv(PROMPT_LOG, str(tmp_path / "prompts.jsonl"))
    with pytest.warns(UserWarning, match="rollout worker's log-probs differ"):
        _fit(tmp_path, 3, engine=f"{__name__}.NeverSyncs")
    gaps = _log(tmp_path)["sampler_check/logp_gap_max"].dropna().tolist()
    assert gaps[0] < ROUNDING and max(gaps[1:]) > 100 * ROUNDING, gaps


def test_the_vllm_recipe_runs_from_the_command_line(tmp_path, monkeypatch):
    """configs/grpo_vllm.yaml as a user runs it (its engine options through LightningCLI), shortened."""
    monkeypatch.setenv(PYTHON_ENV, vllm_python())
    fit_recipe(
        "grpo_vllm.yaml", tmp_path, "--trainer.max_steps=2", "--trainer.accumulate_grad_batches=1",
        "--data.init_args.batch_size=16", "--model.init_args.num_generations=4",
    )  # fmt: skip
    rows = logged_rows(tmp_path / "runs" / "grpo_vllm" / "version_0")
    gaps = [float(r["sampler_check/logp_gap_max"]) for r in rows if r.get("sampler_check/logp_gap_max")]
    assert len(gaps) == 2 and max(gaps) < ROUNDING, gaps
