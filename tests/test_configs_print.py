"""`lit-trainer fit --config configs/<recipe>.yaml --print_config` output is valid input for every recipe."""

from pathlib import Path

import pytest
import yaml

from lit_trainer.cli import LitTrainerCLI

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def _print_config(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        LitTrainerCLI(args=["fit", *args, "--print_config"])
    assert exit_info.value.code in (None, 0)
    return capsys.readouterr().out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_print_config_round_trips(config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    printed = _print_config(["--config", str(config)], capsys)
    (tmp_path / "printed.yaml").write_text(printed)
    again = _print_config(["--config", "printed.yaml"], capsys)
    assert yaml.safe_load(again) == yaml.safe_load(printed)
    assert yaml.safe_load(printed)["model"]["class_path"].startswith("lit_trainer.")


def test_every_recipe_is_covered():
    assert {p.name for p in CONFIGS} >= {"sft.yaml", "sft_chat.yaml", "dpo.yaml", "grpo.yaml"}


def test_every_recipe_writes_its_own_run_folder():
    """Recipes sharing a run name would share `runs/<name>/`, and `--ckpt_path last` of one would resume another's
    checkpoint (a chat or LoRA run resumed as plain SFT)."""
    from lit_trainer.cli.runs import default_run_name

    names = {}
    for config in CONFIGS:
        loaded = yaml.safe_load(config.read_text())
        names[config.name] = loaded.get("run_name") or default_run_name(loaded["model"]["class_path"])
    assert len(set(names.values())) == len(names), names
