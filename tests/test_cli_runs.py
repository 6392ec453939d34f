"""One run = one folder: per-recipe run names, resume into the run's own folder (JIT checkpoint included), refusal
of another run's checkpoint, no overwrite when a saved config is re-run, ``default_root_dir`` as the root."""

from __future__ import annotations

import csv
import errno
import os
from pathlib import Path

import pytest
import torch
import yaml

from helpers.cli import CONFIGS, QUIET_FIT
from helpers.signals import SignalAt
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit
from lit_trainer.cli import LitTrainerCLI

QUIET = [*QUIET_FIT, "--trainer.log_every_n_steps=1"]
FAST = {
    "sft": [],
    "dpo": ["--data.init_args.batch_size", "8"],
    "grpo": [
        "--data.init_args.batch_size",
        "8",
        "--model.init_args.num_generations",
        "4",
        "--model.init_args.max_completion_length",
        "4",
        "--trainer.accumulate_grad_batches",
        "1",
    ],
}


def _fit(recipe: str, steps: int, *args: str, config: str | None = None, **kwargs) -> LitTrainerCLI:
    config = config or str(CONFIGS / f"{recipe}.yaml")
    return LitTrainerCLI(
        args=["fit", "--config", config, "--trainer.max_steps", str(steps), *QUIET, *FAST[recipe], *args], **kwargs
    )


def _steps(run_dir: Path) -> list[int]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get("train_loss")]


@pytest.fixture(scope="module")
def three_recipes(tmp_path_factory) -> Path:
    """The README's sequence in one working directory: SFT (4 steps), DPO (1), GRPO (1)."""
    work = tmp_path_factory.mktemp("recipes")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        _fit("sft", 4, "--trainer.log_every_n_steps", "1")
        _fit("dpo", 1, "--trainer.log_every_n_steps", "1")
        _fit("grpo", 1, "--trainer.log_every_n_steps", "1")
    finally:
        os.chdir(cwd)
    return work


@pytest.mark.slow
def test_each_recipe_writes_its_own_run_folder(three_recipes):
    for recipe in ("sft", "dpo", "grpo"):
        run = three_recipes / "runs" / recipe / "version_0"
        assert (run / "checkpoints" / "last.ckpt").exists(), recipe
        assert (run / "metrics.csv").exists() and (run / "hf_model" / "config.json").exists(), recipe
    assert sorted(p.name for p in (three_recipes / "runs").iterdir()) == ["dpo", "grpo", "sft"]


def test_resume_refuses_another_recipes_checkpoint_naming_both(three_recipes, monkeypatch):
    monkeypatch.chdir(three_recipes)
    grpo = three_recipes / "runs" / "grpo" / "version_0" / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match=r"(?s)GRPOModule.*CausalLMModule") as refused:
        _fit("sft", 6, "--ckpt_path", str(grpo))
    assert str(grpo) in str(refused.value) and "'grpo'" in str(refused.value) and "'sft'" in str(refused.value)
    # the same module under another run name is another run too
    sft = three_recipes / "runs" / "sft" / "version_0" / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match=r"run_name: checkpoint 'sft', this run 'other'"):
        _fit("sft", 6, "--ckpt_path", str(sft), "--run_name", "other")
    assert not (three_recipes / "runs" / "sft" / "version_1").exists()


@pytest.mark.slow
def test_a_finished_run_is_continued_only_on_purpose_and_keeps_its_records(three_recipes, monkeypatch):
    monkeypatch.chdir(three_recipes)
    run = three_recipes / "runs" / "sft" / "version_0"
    first = {name: (run / name).read_bytes() for name in ("config.yaml", "hparams.yaml")}
    # the SFT run reached its max_steps (4): `last` passes it over (after DPO and GRPO ran) and says how to continue it
    with pytest.warns(UserWarning, match=r"(?s)this is a new run.*version_0.*that run finished: step 4"):
        fresh = _fit("sft", 2, "--ckpt_path", "last")
    assert fresh.trainer.ckpt_path is None and Path(fresh.trainer.log_dir).name == "version_1"
    # an explicit path continues it on purpose, in its own folder
    ckpt = run / "checkpoints" / "last.ckpt"
    resumed = _fit("sft", 6, "--trainer.log_every_n_steps", "1", "--ckpt_path", str(ckpt))
    assert Path(resumed.trainer.ckpt_path).resolve() == ckpt.resolve()
    assert resumed.trainer.global_step == 6
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0", "version_1"]  # one run = one folder
    assert _steps(run) == [0, 1, 2, 3, 4, 5]  # one curve: the first 4 steps kept, the resumed ones appended
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["lit_trainer_run"]["run_name"] == "sft"
    # the first part's records are kept as they were; the top-level ones describe the latest part
    assert {name: (run / "parts" / "part_0" / name).read_bytes() for name in first} == first
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"] == 6
    assert yaml.safe_load((run / "parts" / "part_0" / "config.yaml").read_text())["trainer"]["max_steps"] == 4


@pytest.mark.slow
def test_sigterm_checkpoint_is_in_the_run_folder_and_last_resumes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((CONFIGS / "sft.yaml").read_text())
    (jit,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("JITCheckpoint")]
    jit["init_args"] = {"kill_wait": 0}  # save at the next step (the default waits 3 s for a SIGKILL)
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    jit_fast = ["--trainer.log_every_n_steps", "1"]
    with pytest.raises(JITCheckpointExit) as stopped:
        _fit("sft", 6, *jit_fast, config="sft.yaml", trainer_defaults={"callbacks": [SignalAt(2)]})
    assert stopped.value.code == 143
    run = tmp_path / "runs" / "sft" / "version_0"
    saved = Path(stopped.value.checkpoint_path)
    assert saved.parent.resolve() == (run / "checkpoints").resolve() and saved.name.startswith("last-jit-")
    assert not (tmp_path / "checkpoints").exists()
    resumed = _fit("sft", 4, *jit_fast, "--ckpt_path", "last", config="sft.yaml")
    assert Path(resumed.trainer.ckpt_path).resolve() == saved.resolve()
    assert resumed.trainer.global_step == 4
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    assert _steps(run)[-1] == 3


@pytest.mark.slow
def test_rerunning_a_saved_or_printed_config_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _fit("sft", 1)
    first = tmp_path / "runs" / "sft" / "version_0"
    before = {p.name: p.read_bytes() for p in (first / "metrics.csv", first / "checkpoints" / "last.ckpt")}
    saved = first / "config.yaml"
    assert "version: 0" in saved.read_text()  # the saved config records the folder it wrote
    again = LitTrainerCLI(args=["fit", "--config", str(saved), "--trainer.max_steps", "1"])
    assert Path(again.trainer.log_dir).resolve() == (tmp_path / "runs" / "sft" / "version_1").resolve()
    assert {p.name: p.read_bytes() for p in (first / "metrics.csv", first / "checkpoints" / "last.ckpt")} == before
    capsys.readouterr()
    with pytest.raises(SystemExit):
        LitTrainerCLI(args=["fit", "--config", str(saved), "--print_config"])
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    printed = LitTrainerCLI(args=["fit", "--config", "printed.yaml", "--trainer.max_steps", "1"])
    assert Path(printed.trainer.log_dir).name == "version_2"


@pytest.mark.slow
def test_default_root_dir_is_the_root_of_everything_a_run_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _fit("sft", 1, "--trainer.default_root_dir", "out")
    run = tmp_path / "out" / "sft" / "version_0"
    assert Path(cli.trainer.log_dir).resolve() == run.resolve()
    assert cli.trainer.logger.version == 0  # an int: the bar shows `v_num: 0`, not the tail of "version_0"
    assert (run / "metrics.csv").exists() and (run / "checkpoints" / "last.ckpt").exists()
    assert (run / "hf_model" / "model.safetensors").exists() and (run / "config.yaml").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(("steps", "epochs", "wording"), [("-1", "-1", "train forever"), ("-1", "null", "1000 epochs")])
def test_unbounded_fit_is_refused_with_the_right_wording(tmp_path, monkeypatch, steps, epochs, wording):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=wording):
        LitTrainerCLI(
            args=[
                "fit",
                "--config",
                str(CONFIGS / "sft.yaml"),
                "--trainer.max_steps",
                steps,
                "--trainer.max_epochs",
                epochs,
            ]
        )
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_runs_started_at_the_same_instant_each_get_their_own_complete_folder(tmp_path):
    """Four ``lit-trainer fit`` launched together (a sweep, several terminals) once all chose ``version_0``: one
    ``metrics.csv`` with steps twice, ``last-v1.ckpt``, a failed export. Each must reserve a folder of its own."""
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("lit-trainer")
    command = [str(exe) if exe.exists() else "lit-trainer", "fit", "--config", str(CONFIGS / "sft.yaml")]
    command += [*QUIET, "--trainer.max_steps", "2", "--data.init_args.batch_size", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launches = [
        subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(4)
    ]
    outputs = [proc.communicate(timeout=900)[0] for proc in launches]
    for proc, output in zip(launches, outputs):
        assert proc.returncode == 0, output[-3000:]
    runs = sorted((tmp_path / "runs" / "sft").iterdir())
    assert [run.name for run in runs] == [f"version_{n}" for n in range(4)], outputs
    for run in runs:  # each one complete, and written by one process only
        assert _steps(run) == [0, 1], outputs
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
        assert (run / "hf_model" / "config.json").exists() and (run / "config.yaml").exists()
        assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["logger"][0]["init_args"]["version"] == int(
            run.name.removeprefix("version_")
        )
    folders_named = {
        line.split("run folder: ")[1].strip() for out in outputs for line in out.splitlines() if "run folder: " in line
    }
    assert len(folders_named) == 4, folders_named


@pytest.mark.parametrize("error", [errno.EROFS, errno.EACCES])
def test_a_run_root_that_cannot_be_written_is_named_with_the_fix(tmp_path, monkeypatch, capsys, error):
    """A read-only run root (or one without write permission) once gave a 20-line traceback from deep inside the
    loggers; now one line names the folder, the reason and the option that moves it. The file system refuses
    through ``os.mkdir`` (this suite may run as root, which no mode bits stop)."""
    from lit_trainer.cli.app import main

    monkeypatch.chdir(tmp_path)
    real_mkdir = os.mkdir

    def refuse(path, *args, **kwargs):
        if "runs" in str(path):
            raise OSError(error, os.strerror(error), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(CONFIGS / "sft.yaml"), *QUIET, "--trainer.max_steps", "1"])
    assert stopped.value.code == 1
    message = capsys.readouterr().err
    assert f"Cannot create the run folder in {Path('runs') / 'sft'}: {os.strerror(error).lower()}" in message
    assert "--trainer.default_root_dir" in message and "Traceback" not in message
