"""Chained recipes read the run their docs name, and a missing input stops them with the command that writes it.

Every ``runs/<run>/version_<n>/hf_model`` that a shipped config or docs page loads must belong to a run with a known
step (``lit_trainer.run_exports.RECIPE_STEPS``), and that step's command must write that run: its ``--run_name``,
else the config's ``run_name``, else the name the CLI derives from the model class.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from helpers.ddp import output_tail, run_lit_trainer
from lit_trainer.cli.runs import default_run_name
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.run_exports import RECIPE_STEPS

ROOT = Path(__file__).resolve().parents[1]
EXPORT = re.compile(r"runs/([\w.-]+)/version_\d+/hf_model")


def loaded_exports() -> dict[str, set[str]]:
    """``{run name: files}`` of every run export path written in the configs and the docs."""
    found: dict[str, set[str]] = {}
    for path in [*sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "docs").glob("*.md"))]:
        for run in EXPORT.findall(path.read_text()):
            found.setdefault(run, set()).add(path.name)
    return found


def written_run(command: str) -> str:
    """The run name a ``lit-trainer fit`` command writes (``runs/<name>/``)."""
    args = shlex.split(command)
    assert args[:2] == ["lit-trainer", "fit"], command
    options = dict(zip(args[2::2], args[3::2]))
    config = yaml.safe_load((ROOT / options["--config"]).read_text())
    return options.get("--run_name") or config.get("run_name") or default_run_name(config["model"]["class_path"])


def test_every_loaded_export_has_a_step_that_writes_its_run():
    exports = loaded_exports()
    assert {"sft", "reward", "sft_tool_chat"} <= set(exports)  # the scan sees the known chains
    missing = {run: files for run, files in exports.items() if run not in RECIPE_STEPS}
    assert not missing, f"exports loaded with no step in RECIPE_STEPS: {missing}"
    for run, command in RECIPE_STEPS.items():
        assert written_run(command) == run, command


def test_the_rm_pipeline_reads_the_main_job_and_its_reward_model():
    text = (ROOT / "configs" / "grpo_rm.yaml").read_text()
    args = yaml.safe_load(text)["model"]["init_args"]
    assert args["model"] == "runs/sft/version_0/hf_model"  # the main job: a run stopped early is no reproducible start
    assert args["reward_funcs"][0] == "runs/reward/version_0/hf_model"
    for run in ("sft", "reward"):  # the header's commands are the steps the error message names
        assert RECIPE_STEPS[run] in text
    assert RECIPE_STEPS["sft"] in (ROOT / "docs" / "reward.md").read_text()


def test_a_missing_export_names_its_run_and_the_command_that_writes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = "runs/sft/version_0/hf_model"
    for load in (load_model, load_tokenizer):
        with pytest.raises(FileNotFoundError) as error:
            load(path)
        message = str(error.value)
        assert repr(path) in message and "run 'sft'" in message and "runs/sft/ has no run" in message
        assert RECIPE_STEPS["sft"] in message
    (tmp_path / "runs/reward/version_0").mkdir(parents=True)  # a run that has not finished: no hf_model/ yet
    with pytest.raises(FileNotFoundError, match=r"version_0 exists but has no hf_model/: that run has not finished"):
        load_model("runs/reward/version_0/hf_model")
    # the step was run twice (its first run failed): the export is version_1's, and re-running the step would write
    # version_2, so the message points at the export that exists and the option that names it
    (tmp_path / "runs/sft/version_0").mkdir(parents=True)
    (tmp_path / "runs/sft/version_1/hf_model").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as error:
        load_model(path)
    message = str(error.value)
    assert "holds the exports of version_1" in message and "--model.init_args.model" in message
    assert f"replace {path} by {Path('runs/sft/version_1/hf_model')}" in message
    with pytest.raises(FileNotFoundError, match=r"--run_name mine --trainer.default_root_dir out"):
        load_model("out/mine/version_0/hf_model")  # an unknown run in another root: the generic step
    with pytest.raises(FileNotFoundError, match=r"a hub id such as 'org/model'"):
        load_model("./no/such/model")  # not a run export: the general message


@pytest.mark.slow  # the console script imports torch and Lightning (several seconds)
def test_the_rm_recipe_without_its_sft_stage_stops_with_that_command(tmp_path):
    proc = run_lit_trainer("fit", "--config", ROOT / "configs" / "grpo_rm.yaml", cwd=tmp_path)
    assert proc.returncode != 0, output_tail(proc)
    assert RECIPE_STEPS["sft"] in proc.stderr + proc.stdout, output_tail(proc)
    assert "Traceback" not in proc.stderr, output_tail(proc)
