"""Which checkpoint ``lit-trainer fit --ckpt_path last`` continues: only an unfinished run with the same run name and
the same model and data arguments; an explicit path continues a changed or finished run on purpose; a resumed part
keeps the records of the earlier parts; a fresh run that fails before training leaves no folder."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from helpers.cli import CONFIGS, QUIET_FIT
from helpers.refusals import RefuseResume
from helpers.signals import SignalAt
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit
from lit_trainer.callbacks.run_identity import RECORD_KEY
from lit_trainer.cli import LitTrainerCLI, main

QUIET = [*QUIET_FIT, "--trainer.log_every_n_steps=1"]


@pytest.fixture
def sft_config(tmp_path, monkeypatch) -> str:
    """configs/sft.yaml with JITCheckpoint saving at the next step (the shipped kill_wait waits 3 s for a SIGKILL)."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((CONFIGS / "sft.yaml").read_text())
    (jit,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("JITCheckpoint")]
    jit.setdefault("init_args", {})["kill_wait"] = 0
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    return "sft.yaml"


def _fit(config: str, steps: int, *args: str, **kwargs) -> LitTrainerCLI:
    return LitTrainerCLI(args=["fit", "--config", config, "--trainer.max_steps", str(steps), *QUIET, *args], **kwargs)


def _interrupted(config: str, steps: int, at: int, *args: str) -> Path:
    with pytest.raises(JITCheckpointExit) as stopped:
        _fit(config, steps, *args, trainer_defaults={"callbacks": [SignalAt(at)]})
    return Path(stopped.value.checkpoint_path)


def _other_data(folder: Path) -> str:
    path = folder / "other.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"{a}-{a}=0"}) for a in range(10, 60)))
    return str(path)


@pytest.mark.slow
def test_last_continues_the_interrupted_run_not_a_newer_run_on_other_data(sft_config, tmp_path):
    # run A (the main job) stopped by SIGTERM at step 2; then run B on other data, packed, finished: its last.ckpt is
    # the newest file of run name 'sft'
    jit = _interrupted(sft_config, 6, 2)
    other = _other_data(tmp_path)
    _fit(sft_config, 3, "--data.init_args.dataset", other, "--data.init_args.packing", "bfd")
    run_b = tmp_path / "runs" / "sft" / "version_1"
    records_b = {p.name: p.read_bytes() for p in run_b.iterdir() if p.suffix in (".yaml", ".csv")}
    assert set(records_b) == {"config.yaml", "hparams.yaml", "metrics.csv"}
    assert (run_b / "checkpoints" / "last.ckpt").stat().st_mtime_ns > jit.stat().st_mtime_ns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(sft_config, 6, "--ckpt_path", "last")
    assert not [w for w in caught if "Passed over" in str(w.message)]  # run A was found: no word on run B needed
    assert Path(resumed.trainer.ckpt_path).resolve() == jit.resolve()
    assert resumed.trainer.global_step == 6
    assert Path(resumed.trainer.log_dir).resolve() == (tmp_path / "runs" / "sft" / "version_0").resolve()
    # run B's records are untouched
    assert {p.name: p.read_bytes() for p in run_b.iterdir() if p.suffix in (".yaml", ".csv")} == records_b


@pytest.mark.slow
def test_a_changed_model_or_data_argument_is_passed_over_naming_the_key_and_the_explicit_path(sft_config, tmp_path):
    jit = _interrupted(sft_config, 6, 2)
    with pytest.warns(UserWarning, match="Passed over") as caught:
        fresh = _fit(sft_config, 3, "--model.init_args.learning_rate", "0.001", "--ckpt_path", "last")
    message = next(str(w.message) for w in caught if "Passed over" in str(w.message))
    assert "model.init_args.learning_rate: checkpoint 0.003, this run 0.001" in message
    assert str(jit) in message and "--ckpt_path PATH" in message
    assert fresh.trainer.ckpt_path is None and Path(fresh.trainer.log_dir).name == "version_1"
    assert fresh.trainer.global_step == 3  # a new run from step 0


@pytest.mark.slow
def test_options_a_resume_may_change_keep_it_the_same_run(sft_config, tmp_path):
    jit = _interrupted(sft_config, 6, 2)
    resumed = _fit(
        sft_config,
        5,  # trainer options (max_steps, logging) and data-loading / validation options may change
        "--trainer.log_every_n_steps=2",
        "--data.init_args.eval_batch_size=100",
        "--data.init_args.num_workers=0",
        "--model.init_args.eval_max_new_tokens=4",
        "--ckpt_path",
        "last",
    )
    assert Path(resumed.trainer.ckpt_path).resolve() == jit.resolve() and resumed.trainer.global_step == 5


@pytest.mark.slow
def test_an_explicit_path_continues_a_changed_configuration_with_a_warning_and_keeps_each_parts_config(
    sft_config, tmp_path
):
    jit = _interrupted(sft_config, 6, 2)
    run = tmp_path / "runs" / "sft" / "version_0"
    first = (run / "config.yaml").read_bytes()
    with pytest.warns(UserWarning, match=r"changed configuration \(model.init_args.learning_rate: checkpoint 0.003"):
        second = _interrupted(sft_config, 6, 4, "--model.init_args.learning_rate", "0.001", "--ckpt_path", str(jit))
    assert second.parent == jit.parent
    third = _fit(sft_config, 6, "--model.init_args.learning_rate", "0.001", "--ckpt_path", "last")
    assert Path(third.trainer.ckpt_path).resolve() == second.resolve()  # the run's newest state: the second part's
    parts = sorted(p.name for p in (run / "parts").iterdir())
    assert parts == ["part_0", "part_1"]
    assert (run / "parts" / "part_0" / "config.yaml").read_bytes() == first
    rates = [
        yaml.safe_load(path.read_text())["model"]["init_args"]["learning_rate"]
        for path in (run / "parts" / "part_0" / "config.yaml", run / "parts" / "part_1" / "config.yaml")
    ]
    assert rates == [0.003, 0.001]


def test_the_record_names_the_configuration_and_whether_the_run_finished(sft_config, tmp_path):
    cli = _fit(sft_config, 2)
    record = torch.load(Path(cli.trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)[RECORD_KEY]
    assert record["finished"] is True and record["global_step"] == 2
    config = record["config"]
    assert config["model.class_path"] == "lit_trainer.CausalLMModule"
    assert config["model.init_args.learning_rate"] == 0.003 and config["data.init_args.dataset"] == "builtin:addition"
    assert not any(key.startswith("trainer.") for key in config)


def test_a_fresh_run_that_fails_before_training_leaves_no_folder(sft_config, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"unrelated": 1}) + "\n")
    with pytest.raises(Exception):  # noqa: B017  (whatever the data error is, the folder must go)
        _fit(sft_config, 2, "--data.init_args.dataset", str(bad))
    assert not (tmp_path / "runs" / "sft").exists() or not any((tmp_path / "runs" / "sft").iterdir())


def test_a_run_refused_while_its_classes_are_built_leaves_no_reserved_folder(sft_config, tmp_path):
    """`fit` reserves its folder before the model and data are built; an argument refused by a module's own check
    (here at construction) must not leave that empty folder behind to push the next run to version_1."""
    with pytest.raises(ValueError, match="max_grad_norm=-1"):
        _fit(sft_config, 2, "--model.init_args.max_grad_norm=-1")
    assert not any((tmp_path / "runs" / "sft").iterdir())
    _fit(sft_config, 1)
    assert sorted(p.name for p in (tmp_path / "runs" / "sft").iterdir()) == ["version_0"]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "refusal",
    ["an argument refused when the module is built", "a data file refused before setup", "a refused checkpoint"],
)
def test_a_refused_resume_writes_nothing_in_the_run_folder(sft_config, tmp_path, capsys, refusal):
    jit = _interrupted(sft_config, 6, 2)  # an unfinished run: `--ckpt_path last` continues it
    run = tmp_path / "runs" / "sft" / "version_0"
    before = _files(run)
    assert {"config.yaml", "hparams.yaml", "metrics.csv"} <= set(before)
    capsys.readouterr()
    if refusal == "a refused checkpoint":  # by a callback, after the run's setup has written its records
        with pytest.raises(ValueError, match="RefuseResume: this checkpoint is refused"):
            _fit(sft_config, 6, "--ckpt_path", "last", trainer_defaults={"callbacks": [RefuseResume()]})
    else:
        (tmp_path / "empty.jsonl").write_text("")
        changed, shown = {
            "an argument refused when the module is built": ("--model.init_args.max_grad_norm=-1", "max_grad_norm=-1"),
            "a data file refused before setup": ("--data.init_args.dataset=empty.jsonl", "empty.jsonl is empty"),
        }[refusal]
        with pytest.raises(SystemExit):
            main(["fit", "--config", sft_config, "--trainer.max_steps", "6", *QUIET, changed, "--ckpt_path", str(jit)])
        assert shown in capsys.readouterr().err
    assert _files(run) == before  # config.yaml and every other file byte for byte, and no new file
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
