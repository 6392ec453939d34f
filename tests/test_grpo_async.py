"""Asynchronous GRPO rollouts (``max_staleness``): a worker process samples the rounds.

What is pinned here: ``max_staleness=0`` is the synchronous run bit for bit (the worker computes the same thing), a
resume is exact at 0 and, from a checkpoint without the weights versions of ``max_staleness=1`` (a k = 0 one),
regenerates the rounds in flight with the resumed weights (exact resumes at k > 0: tests/test_grpo_async_resume.py),
stale rounds carry the importance-sampling correction and their staleness, the sampler check finds no gap when the
worker has the trainer's weights and warns when a sync is broken on purpose; plus the pieces without a process (shared
weight slots, the loader's read-ahead, option checks). Shutdown on signals, LoRA, tools and DDP:
tests/test_grpo_async_shutdown.py and tests/test_grpo_async_paths.py.
"""

from __future__ import annotations

import pickle
import queue
import signal
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_grpo_module import QUIET, data, grpo, length_reward, tiny_model

from lit_trainer.data.prompt import RolloutGeometry
from lit_trainer.generation.engines import make_engine
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.modules.grpo._async._errors import death_message
from lit_trainer.modules.grpo._async._worker import Deferred, RoundRequest, SharedWeights, worker_main
from lit_trainer.modules.online_rl._logps import CompletionScorer

WARNING = "rollout worker's log-probs differ"
SAME_WEIGHTS_GAP = 1e-5  # largest |delta log p| of the sampler check on the same weights (see its first use)


def fit(steps: int, root: Path | None = None, ckpt_path: str | None = None, every: int = 0, **options: Any):
    """A tiny GRPO fit (16 prompts, 8 completions per micro-step) and the module; a CSV log under ``root``."""
    L.seed_everything(0)
    module = grpo(**options)
    trainer_options = {**QUIET, "enable_checkpointing": bool(every)}
    if root is not None:
        trainer_options["logger"] = CSVLogger(root, name="log")
    callbacks = [ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1)] if every else []
    L.Trainer(max_steps=steps, callbacks=callbacks, log_every_n_steps=1, default_root_dir=root, **trainer_options).fit(
        module, datamodule=data(n=16, batch_size=8), ckpt_path=ckpt_path
    )
    return module


def same_weights(a: GRPOModule, b: GRPOModule) -> None:
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), name


def logged(root: Path) -> pd.DataFrame:
    versions = sorted((root / "log").iterdir())
    return pd.read_csv(versions[-1] / "metrics.csv")


# ------------------------------------------------------------------------------------------------ with a worker
@pytest.mark.slow
def test_max_staleness_zero_is_the_synchronous_run_bit_for_bit(tmp_path):
    """Two optimizer steps per round (steps_per_generation=2), so the rounds' old log-probs are stored too; the
    worker is stopped when fitting ends."""
    synchronous = fit(4, steps_per_generation=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = fit(4, tmp_path, steps_per_generation=2, max_staleness=0)
    same_weights(synchronous, worker)
    assert worker.async_rollouts.worker is None
    log = logged(tmp_path)
    assert (log["async/staleness"].dropna() == 0).all()
    gaps = log["sampler_check/logp_gap_max"].dropna()
    # the worker scores with the trainer's code and weights: 0 here; up to 1.3e-6 measured in configs/grpo_async.yaml
    # (float32 kernels may differ with the memory layout of the loaded weights); a broken sync gives > 0.07
    assert len(gaps) > 0 and (gaps < SAME_WEIGHTS_GAP).all()
    assert not any(WARNING in str(w.message) for w in caught)


@pytest.mark.slow
def test_resume_is_exact_at_max_staleness_zero_and_regenerates_rounds_in_flight(tmp_path):
    uninterrupted = fit(4)
    fit(4, tmp_path / "first", every=2, max_staleness=0)
    checkpoint = str(tmp_path / "first" / "epoch=0-step=2.ckpt")
    resumed = fit(4, ckpt_path=checkpoint, max_staleness=0)
    same_weights(uninterrupted, resumed)
    # max_staleness=1 from the same checkpoint: it keeps no older weights (k = 0 needs none), so the first round after
    # the resume is sampled by the resumed weights, and a warning says so
    with pytest.warns(UserWarning, match="without the weights versions that sampled the rounds in flight"):
        fit(4, tmp_path / "stale", ckpt_path=checkpoint, max_staleness=1)
    assert logged(tmp_path / "stale")["async/staleness"].dropna().tolist() == [0.0, 1.0]


@pytest.mark.slow
def test_stale_rounds_are_corrected_and_a_broken_weight_sync_warns(tmp_path):
    """max_staleness=1: from the second round on, rounds are one round stale, carry TRL's sampling metrics and the
    importance-sampling ratio; the sampler check (the trainer loads the weights version the worker used) finds no gap.
    With an engine that never loads the published weights, the check warns once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = fit(4, tmp_path / "ok", max_staleness=1, rollout_importance_sampling_mode="token_truncate")
    assert not any(WARNING in str(w.message) for w in caught)
    log = logged(tmp_path / "ok")
    assert log["async/staleness"].dropna().tolist() == [0.0, 1.0, 1.0, 1.0]
    assert (log["sampler_check/logp_gap_max"].dropna() < SAME_WEIGHTS_GAP).all()
    ratio = log["sampling/importance_sampling_ratio/mean"].dropna()
    assert len(ratio) == 3 and (ratio != 1.0).all()  # weights moved between sampling and training
    assert (log["sampling/importance_sampling_ratio/max"].dropna() <= 3.0).all()  # truncated at clip_max
    assert "sampling_logps" in module._buffer.slices[0]  # the ratio is taken in the loss, from the step's log-probs

    with pytest.warns(UserWarning, match=WARNING) as caught:
        fit(4, tmp_path / "broken", max_staleness=1, rollout_engine="helpers.engines.NoWeightSync")
    assert sum(WARNING in str(w.message) for w in caught) == 1  # once
    assert logged(tmp_path / "broken")["sampler_check/logp_gap_mean"].dropna().max() > 0.05


@pytest.mark.slow
def test_continuous_batching_in_the_worker_is_the_synchronous_run():
    """The worker samples through the same engine interface: transformers' continuous batching there equals it here
    (a small paged cache, so one round takes well under a second)."""
    options = {
        "use_transformers_continuous_batching": True,
        "transformers_continuous_batching_config": {"num_blocks": 64, "max_batch_tokens": 1024},
        "steps_per_generation": 1,
    }
    same_weights(fit(1, **options), fit(1, max_staleness=0, **options))


@pytest.mark.slow
def test_a_worker_that_cannot_import_a_class_says_why(monkeypatch):
    """A class the worker cannot import (a module subclass's behaviour scorer defined in a notebook: its module exists
    in the training process only) killed the worker while it unpickled its arguments, before it could report anything,
    and the fit failed with "died with exit code 1 (out of memory?)". The error now starts with the worker's
    exception."""
    notebook = types.ModuleType("notebook_cell")

    class NotebookScorer(CompletionScorer):
        pass

    class NotebookGRPO(GRPOModule):
        def behaviour_scorer(self) -> NotebookScorer:
            return NotebookScorer(self.hparams.temperature)

    NotebookScorer.__module__, NotebookScorer.__qualname__ = "notebook_cell", "NotebookScorer"
    notebook.NotebookScorer = NotebookScorer
    monkeypatch.setitem(sys.modules, "notebook_cell", notebook)  # importable here, not in a new process
    module = NotebookGRPO(
        tiny_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward], num_generations=4,
        max_completion_length=4, max_staleness=0,
    )  # fmt: skip
    with pytest.raises(RuntimeError) as failed:
        L.Trainer(max_steps=1, **QUIET).fit(module, datamodule=data(n=8, batch_size=4))
    message = str(failed.value)
    first = "failed to start: ModuleNotFoundError: No module named 'notebook_cell'"
    assert first in message.splitlines()[0] and "out of memory" not in message, message
    assert module.async_rollouts.worker is None  # stopped


# --------------------------------------------------------------------------------------------- without a worker
def test_a_dead_worker_is_described_by_its_exit_status_without_a_guess():
    """A worker that dies without reporting an error is described by its signal or exit code and the round, in one
    line. SIGKILL names the kernel's out-of-memory killer only as one of its possible senders (the report: "(out of
    memory?)" was printed as the cause); no other exit mentions memory."""
    message = death_message(7, -signal.SIGKILL, 3)
    assert message.startswith("The GRPO rollout worker (pid 7) was killed by signal 9 (SIGKILL) at round 3 ")
    assert "\n" not in message and "?" not in message and "out-of-memory killer" in message, message
    others = [(1, "exited with code 1"), (-signal.SIGSEGV, "killed by signal 11 (SIGSEGV)"), (None, "code None")]
    for code, how in others:
        message = death_message(7, code, 0)
        assert f"{how} at round 0" in message and "memory" not in message, message


def test_shared_weight_slots_hold_one_version_each():
    weights = SharedWeights({"w": torch.zeros(2)}, slots=2)
    for version in range(3):
        weights.publish(version, {"w": torch.full((2,), float(version))})
    assert torch.equal(weights.read(2)["w"], torch.tensor([2.0, 2.0]))
    assert torch.equal(weights.read(1)["w"], torch.tensor([1.0, 1.0]))
    with pytest.raises(RuntimeError, match="version 0 is not in shared memory"):
        weights.read(0)  # overwritten by version 2
    assert weights.holds(1) and weights.holds(2) and not weights.holds(0) and not weights.holds(3)


def test_the_loader_read_ahead_is_what_the_loader_yields():
    """``TrainLoader.peek`` (where the worker's future prompts come from) equals the micro-batches of two epochs of
    the shuffled loader, and says None past an epoch's end."""
    datamodule = data(n=16, batch_size=4, sampling="random")
    loader = datamodule.generation_loader(RolloutGeometry(4, 2, 8, 1))
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == 16  # 8 chunks of 2 prompts, each served twice (steps_per_generation=2)
        for index, batch in enumerate(batches):
            ahead = loader.peek(epoch, index)
            assert torch.equal(ahead["prompt_input_ids"], batch["prompt_input_ids"])
            assert ahead["prompts"] == batch["prompts"]
    assert loader.peek(0, 16) is None
    assert loader.peek(0, 0)["prompts"] != loader.peek(1, 0)["prompts"]  # another epoch, another order


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_staleness": -1}, "max_staleness=-1"),
        ({"rollout_worker_threads": 0}, "rollout_worker_threads=0"),
        ({"sampler_check_threshold": 0.0}, "sampler_check_threshold=0.0"),
        ({"rollout_importance_sampling_mode": "token"}, "rollout_importance_sampling_mode='token'"),
        ({"rollout_importance_sampling_clip_min": 2.0, "rollout_importance_sampling_clip_max": 1.0}, "minimum"),
        (
            {"rollout_importance_sampling_mode": "token_truncate", "rollout_importance_sampling_clip_max": None},
            "both bounds are None",
        ),
        ({"loss_type": "vespo", "max_staleness": 1}, "VESPO folds a per-token"),
    ],
)
def test_async_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        grpo(**options)


def test_a_rollout_func_cannot_run_in_the_worker():
    module = grpo(max_staleness=1, rollout_func=lambda prompts, module: {})
    with pytest.raises(ValueError, match="rollout_func runs in the training process"):
        L.Trainer(max_steps=1, **QUIET).fit(module, datamodule=data(n=16, batch_size=8))
    assert module.async_rollouts.worker is None


class ShiftedScorer(CompletionScorer):
    """A subclass's behaviour scorer: the default forward, shifted by 1 (a marker no default forward gives)."""

    def __call__(self, model: Any, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().__call__(model, rows) + 1.0


class ShiftedGRPO(GRPOModule):
    """A subclass with its own log-prob forward and the scorer that runs it in the rollout worker."""

    def completion_logps(self, model: Any, rows: dict[str, torch.Tensor], **options: Any) -> tuple:
        logps, entropy = super().completion_logps(model, rows, **options)
        return logps + 1.0, entropy

    def behaviour_scorer(self) -> ShiftedScorer:
        return ShiftedScorer(self.hparams.temperature)


class ForwardOnly(GRPOModule):
    def completion_logps(self, model: Any, rows: dict[str, torch.Tensor], **options: Any) -> tuple:
        return super().completion_logps(model, rows, **options)


def _worker_round(module: GRPOModule) -> dict[str, Any]:
    """One round of 8 rows (2 prompts x 4) from ``module``'s worker spec, run by ``worker_main`` in this process: the
    spec pickled as it travels to the worker process, unpickled by the worker, its weights published as version 0."""
    tokenizer = module.tokenizer
    ids = torch.tensor([tokenizer("10+11=").input_ids[:-1]] * 4 + [tokenizer("12+11=").input_ids[:-1]] * 4)
    batch = {"prompts": ["10+11="] * 4 + ["12+11="] * 4, "prompt_input_ids": ids, "prompt_attention_mask": ids > -1}
    module.rollout_geometry = RolloutGeometry(4, 2, 8, 1)  # what setup sets: two micro-batches of 4 rows per round
    spec = module.async_rollouts.worker_spec(module, module.model, "cpu")
    weights = SharedWeights({n: p.detach() for n, p in module.model.named_parameters()}, slots=1)
    weights.publish(0, dict(module.model.named_parameters()))
    requests, results = queue.Queue(), queue.Queue()
    for request in (
        (Deferred(data=pickle.dumps(spec)), weights),
        RoundRequest(0, 0, batch, seed=3, training=False),
        None,
    ):
        requests.put(request)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the worker ignores both
    try:
        worker_main(requests, results)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert results.get_nowait()[1] == "started"
    index, status, result = results.get_nowait()
    assert (index, status) == (0, "ok"), result
    return result


def test_a_subclass_scorer_reaches_the_worker_and_matches_its_forward():
    """The extension point of the worker's behaviour log-probs: a subclass's ``behaviour_scorer`` is pickled to the
    worker and runs there. Its log-probs of the first group are the trainer's ``completion_logps`` bit for bit (what
    the sampler check compares, same rows, same shapes), and the rest equal them to the sampler check's calibrated
    gap (other chunk shapes); the default forward is 1 away."""
    torch.manual_seed(0)
    module = ShiftedGRPO(tiny_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward],
                         num_generations=4, max_completion_length=4, rollout_worker_threads=1)  # fmt: skip
    result = _worker_round(module)
    rows, behaviour = result["rows"], result["sampling_logps"]
    with torch.no_grad():
        mine = module.completion_logps(module.model, rows)[0]
        head = module.completion_logps(module.model, {k: v[:4] for k, v in rows.items()})[0]
        default = GRPOModule.completion_logps(module, module.model, rows)[0]
    assert behaviour.shape == (8, rows["completion_ids"].shape[1])
    assert torch.equal(behaviour[:4], head)
    torch.testing.assert_close(behaviour, mine, rtol=0, atol=SAME_WEIGHTS_GAP)
    torch.testing.assert_close(behaviour - 1.0, default, rtol=0, atol=SAME_WEIGHTS_GAP)


def test_a_forward_override_without_a_scorer_override_warns():
    """A subclass's own ``completion_logps`` does not reach the worker by itself: starting the worker says so (a
    module that overrides neither, or both, does not warn)."""
    modules = [ForwardOnly(tiny_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward]), grpo()]
    modules.append(ShiftedGRPO(tiny_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward]))
    for module in modules:
        module.rollout_geometry = RolloutGeometry(4, 1, 4, 1)
    with pytest.warns(UserWarning, match="ForwardOnly overrides completion_logps but not behaviour_scorer"):
        modules[0].async_rollouts.worker_spec(modules[0], modules[0].model, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module in modules[1:]:
            module.async_rollouts.worker_spec(module, module.model, "cpu")


def test_a_rollout_engine_must_be_a_rollout_engine():
    with pytest.raises(ValueError, match="not a RolloutEngine subclass"):
        make_engine(False, None, "collections.OrderedDict")
    assert type(make_engine(False, None, "helpers.engines.NoWeightSync")).__name__ == "NoWeightSync"


@pytest.mark.slow
def test_a_policy_of_more_than_250_tensors_starts_its_worker():
    """The forkserver passes a new process's file descriptors (one per shared tensor) in one message, capped at 253 by
    the kernel: a policy of 273 tensors (SmolLM2-135M's count) as the worker's arguments could not start it ("too
    many fds"). They go through the request queue, which hands descriptors over one at a time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=30, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert len(list(model.parameters())) > 253
    module = fit(2, model=model, max_staleness=0)
    assert module.async_rollouts.worker is None  # it ran both rounds and was stopped
