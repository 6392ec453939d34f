"""A signal during a GRPO generation round, and the logs of a stopped run (issue 31, items 2 and 3).

* A signal stops a generation in progress (a stopping criterion reads JITCheckpoint's request), the partial round is
  dropped, the last finished optimizer step is saved and the run exits 143; the resumed run regenerates that round
  and ends bit-exact against an uninterrupted one.
* Every optimizer step has exactly one row in ``metrics.csv`` and in Trackio, whatever stopped the run: SIGTERM,
  Ctrl-C (the row of the step the checkpoint holds used to be lost), or SIGKILL after a checkpoint (the rows logged
  after it used to appear twice).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml

from helpers.cli import CONFIGS, QUIET_FIT
from helpers.ddp import output_tail, run_lit_trainer, script_env
from helpers.trackio_store import new_project, runs, steps_of
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit
from lit_trainer.cli import LitTrainerCLI

SMALL_GRPO = ["--data.init_args.batch_size", "16", "--trainer.log_every_n_steps", "1"]
VARIED = ["--model.init_args.reward_funcs", "[helpers.signals.distinct_tokens_reward]"]


def _config(tmp_path: Path, name: str, kill_wait: float = 0.0, every_n_train_steps: int | None = None) -> str:
    """configs/<name> with JITCheckpoint's kill_wait set (the recipes wait 3 s for a SIGKILL after a SIGTERM)."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("JITCheckpoint"):
            callback["init_args"] = {**callback.get("init_args", {}), "kill_wait": kill_wait}
        if every_n_train_steps and callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"] = {"every_n_train_steps": every_n_train_steps, "save_last": True}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _signal(step: int, name: str = "SIGTERM", at_start: bool = False, delay: float = 0.0) -> list[str]:
    args = ["--trainer.callbacks+=helpers.signals.SignalAt", f"--trainer.callbacks.step={step}"]
    args += [f"--trainer.callbacks.signal_name={name}", f"--trainer.callbacks.at_start={str(at_start).lower()}"]
    return [*args, f"--trainer.callbacks.delay={delay}"]


def _train_rows(run: Path) -> dict[int, dict[str, str]]:
    """``{step: row}`` of the training rows of ``metrics.csv``; fails on a step written twice."""
    with open(run / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), f"a step has two rows: {steps}"
    return {int(r["step"]): r for r in rows}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_sigterm_during_a_generation_that_would_take_hours_stops_it_and_exits_143(tmp_path):
    """The round's generation is 100,000 tokens per row with EOS suppressed (hours on CPU); a SIGTERM one second in
    is acknowledged at once, stops it within a token, and the step-0 state is saved (the subprocess's 900 s timeout
    is the hang guard: no timing is asserted)."""
    config = _config(tmp_path, "grpo.yaml")
    long = ["--model.init_args.max_completion_length", "100000"]
    long += ["--model.init_args.generation_kwargs", '{"min_new_tokens": 100000}']
    fit = ["fit", "--config", config, *QUIET_FIT, "--trainer.max_steps", "2", *SMALL_GRPO, *long]
    stopped = run_lit_trainer(*fit, *_signal(0, at_start=True, delay=1.0), cwd=tmp_path, **script_env())
    assert stopped.returncode == 143, output_tail(stopped)
    assert "JITCheckpoint: SIGTERM received on rank 0" in stopped.stderr, output_tail(stopped)
    saved = tmp_path / "runs/grpo/version_0/checkpoints/last-jit-epoch=0-step=0.ckpt"
    assert saved.is_file(), output_tail(stopped)
    state = torch.load(saved, weights_only=False)
    assert state["global_step"] == 0 and state["grpo_rollouts"]["ranks"][0]["rounds"] == 0  # the round was dropped


@pytest.mark.slow
def test_a_signal_inside_a_grpo_round_drops_it_and_the_resume_is_bit_exact(tmp_path, monkeypatch):
    """The signal arrives as step 3's round starts (before its generation): the checkpoint holds step 2, the
    resumed run generates that round again from its seed, and weights and logged rows equal an uninterrupted run's."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "grpo.yaml")
    fit = ["fit", "--config", config, *QUIET_FIT, "--trainer.max_steps", "4", *SMALL_GRPO, *VARIED]
    from helpers.signals import SignalAt

    with pytest.raises(JITCheckpointExit) as stopped:
        LitTrainerCLI(args=fit, trainer_defaults={"callbacks": [SignalAt(2, at_start=True)]})
    assert stopped.value.code == 143
    assert Path(stopped.value.checkpoint_path).name == "last-jit-epoch=0-step=2.ckpt"  # not step 3: the round was cut
    LitTrainerCLI(args=[*fit, "--ckpt_path", "last"])
    reference = LitTrainerCLI(args=[*fit, "--run_name", "reference"])
    run, ref = tmp_path / "runs/grpo/version_0", Path(reference.trainer.log_dir)
    ours, theirs = _weights(run), _weights(ref)
    at_stop = torch.load(stopped.value.checkpoint_path, weights_only=True)["state_dict"]
    assert any(not torch.equal(at_stop[k], theirs[k]) for k in theirs)  # steps 3-4 moved the weights
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    rows, expected = _train_rows(run), _train_rows(ref)
    assert sorted(rows) == sorted(expected) == [0, 1, 2, 3]
    for step in expected:  # the same training, so the same values (the timing columns aside)
        for key in ("train_loss", "reward", "grad_norm", "completions/mean_length"):
            assert rows[step][key] == expected[step][key], (step, key)


@pytest.mark.slow
def test_the_step_a_sigterm_checkpoint_holds_is_logged_once_in_csv_and_trackio(tmp_path):
    """Through the console script, GRPO's own logging: stopped at step 2, resumed to 4; steps 0..3 once each (Ctrl-C
    takes the same path: the in-process test below)."""
    project = new_project()
    env = {**script_env(), "TRACKIO_PROJECT": project}
    config = _config(tmp_path, "grpo.yaml")
    fit = ["fit", "--config", config, *QUIET_FIT, "--trainer.max_steps", "4", *SMALL_GRPO, "--report_to", "trackio"]
    stopped = run_lit_trainer(*fit, *_signal(2), cwd=tmp_path, **env)
    assert stopped.returncode == 143, output_tail(stopped)
    run = tmp_path / "runs/grpo/version_0"
    assert sorted(_train_rows(run)) == [0, 1]  # logger step 1 = optimizer step 2, the one the checkpoint holds
    resumed = run_lit_trainer(*fit, "--ckpt_path", "last", cwd=tmp_path, **env)
    assert resumed.returncode == 0, output_tail(resumed)
    assert sorted(_train_rows(run)) == [0, 1, 2, 3]
    (trackio_run,) = runs(project)
    assert steps_of(project, trackio_run["id"], "train_loss") == [0, 1, 2, 3]


@pytest.mark.slow
def test_after_a_sigkill_the_rows_logged_after_the_last_checkpoint_are_not_doubled(tmp_path):
    """SIGKILL at step 4 with checkpoints every 2 steps: the part killed had logged step 3 (logger step 2) after
    the step-2 checkpoint; the resume logs it again, and metrics.csv keeps one row per step (the rows logged after
    the checkpoint are dropped on resume, as Trackio's)."""
    config = _config(tmp_path, "sft.yaml", every_n_train_steps=2)
    fit = ["fit", "--config", config, *QUIET_FIT, "--trainer.max_steps", "5", "--trainer.log_every_n_steps", "1"]
    killed = run_lit_trainer(*fit, *_signal(4, "SIGKILL"), cwd=tmp_path, **script_env())
    assert killed.returncode == -9, output_tail(killed)
    run = tmp_path / "runs/sft/version_0"
    assert sorted(_train_rows(run)) == [0, 1, 2]
    resumed = run_lit_trainer(*fit, "--ckpt_path", "last", cwd=tmp_path, **script_env())
    assert resumed.returncode == 0, output_tail(resumed)
    assert sorted(_train_rows(run)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("log_every", [1, 3])
def test_ctrl_c_between_two_logging_steps_logs_the_window_once(tmp_path, monkeypatch, log_every):
    """SFT (the base module's logging window), Ctrl-C at step 4 of 6: with log_every_n_steps=3 the window of steps
    4 is written when the run stops (logger step 3) instead of being lost, and the resumed run logs 5..6 at 5."""
    from helpers.signals import SignalAt

    monkeypatch.chdir(tmp_path)
    fit = ["fit", "--config", str(CONFIGS / "sft.yaml"), *QUIET_FIT, "--trainer.max_steps", "6"]
    fit += ["--trainer.log_every_n_steps", str(log_every)]
    with pytest.raises(JITCheckpointExit):
        LitTrainerCLI(args=fit, trainer_defaults={"callbacks": [SignalAt(4, "SIGINT")]})
    LitTrainerCLI(args=[*fit, "--ckpt_path", "last"])
    rows = _train_rows(tmp_path / "runs/sft/version_0")
    expected = [0, 1, 2, 3, 4, 5] if log_every == 1 else [2, 3, 5]
    assert sorted(rows) == expected


def test_the_stopping_criterion_changes_no_token_until_it_fires_then_ends_the_generation():
    """The same seeded sampling with a check that stays False gives the same tokens as without it; a check that turns
    True at its 3rd call (after the 3rd token) ends every row there, although EOS is suppressed for 50 tokens."""
    from transformers import GenerationConfig

    from helpers.models import tiny_llama
    from lit_trainer.generation.engines import generate_completions

    model = tiny_llama()
    prompt, mask = torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    config = GenerationConfig(max_new_tokens=50, min_new_tokens=50, do_sample=True, pad_token_id=0, eos_token_id=1)

    def sample(check):
        torch.manual_seed(0)
        return generate_completions(model, prompt, mask, config, [1], should_stop=check)

    plain, never = sample(None), sample(lambda: False)
    assert plain.ids.shape == (2, 50) and torch.equal(plain.ids, never.ids)
    calls = []
    stopped = sample(lambda: calls.append(1) or len(calls) >= 3)
    assert stopped.ids.shape == (2, 3) and torch.equal(stopped.ids, plain.ids[:, :3])
    assert stopped.truncated.all()


def test_a_stop_request_ends_the_tool_loop_before_any_tool_runs():
    """Every row's first turn calls a tool; with the request on, the loop ends after that turn: no tool is run and
    ``generate`` is called once (without it, the same call runs the tool and generates again)."""
    from helpers.tool_policy import add, call
    from lit_trainer.generation.agentic.multi_turn import multi_turn_rollouts
    from lit_trainer.models import build_tokenizer

    tokenizer = build_tokenizer()
    calls = []

    def always_call(inputs: list[list[int]], budget: int) -> list[list[int]]:
        calls.append(len(inputs))
        return [tokenizer(call({"a": 2, "b": 2}), add_special_tokens=False)["input_ids"][:budget] for _ in inputs]

    prompt = [tokenizer.apply_chat_template([{"role": "user", "content": "2+2=?"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)]  # fmt: skip
    options = {"max_completion_length": 500, "max_iterations": 3, "eos_ids": [1], "pad_token_id": 0}
    stopped = multi_turn_rollouts(always_call, tokenizer, prompt, [{"add": add}], should_stop=lambda: True, **options)
    assert calls == [1] and stopped.stats.calls == 0 and len(stopped.messages[0]) == 1
    calls.clear()
    going = multi_turn_rollouts(always_call, tokenizer, prompt, [{"add": add}], should_stop=lambda: False, **options)
    assert calls == [1, 1, 1, 1] and going.stats.calls == 3
