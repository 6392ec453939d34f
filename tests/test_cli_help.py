"""``lit-trainer --help`` answers from the recipe files without importing torch or Lightning; ``fit --help`` tells how
to list the model and data options and what ``--ckpt_path`` means here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lit_trainer.cli.app import CKPT_PATH_HELP, LitTrainerCLI
from lit_trainer.cli.entry import quick_help, recipe_summary
from lit_trainer.cli.trackers import REPORT_TO_HELP

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_quick_help_imports_neither_torch_nor_lightning():
    code = (
        "import sys; from lit_trainer.cli.entry import main; main(['--help']); "
        "heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: lit-trainer" in proc.stdout


def test_quick_help_names_every_recipe_with_a_whole_sentence_and_the_commands(tmp_path):
    text = quick_help(cwd=tmp_path)  # no configs/ here: the checkout's recipes are listed
    for config in sorted(CONFIGS.glob("*.yaml")):
        (line,) = [line for line in text.splitlines() if line.strip().startswith(config.name + " ")]
        summary = recipe_summary(config.read_text())
        assert summary and line.rstrip().endswith(summary), config.name
        assert not summary.endswith((",", " the", " a", " so", " no", " and")), summary  # never cut mid-sentence
    for command in (
        "fit --config configs/sft.yaml",
        "--ckpt_path last",
        "--report_to",
        "fit --help",
        "validate",
        "mkdocs serve",
    ):
        assert command in text


def test_quick_help_prefers_the_working_directorys_recipes(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.yaml").write_text("# My own recipe. More text.\nseed_everything: 1\n")
    text = quick_help(cwd=tmp_path)
    assert "  mine.yaml  My own recipe\n" in text and "  sft.yaml " not in text


@pytest.mark.parametrize("args", [[], ["-h"], ["--help"]])
def test_console_script_answers_help_without_arguments_or_with_h(args, capsys):
    from lit_trainer.cli.entry import main

    main(args)
    assert capsys.readouterr().out.startswith("lit-trainer ")


def test_fit_help_says_how_to_list_model_and_data_options_and_what_ckpt_path_means(capsys):
    with pytest.raises(SystemExit) as done:
        LitTrainerCLI(args=["fit", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--model.help lit_trainer.CausalLMModule" in text and "--data.help lit_trainer.data.SFTDataModule" in text
    assert "--model.init_args.learning_rate" in text
    assert " ".join(CKPT_PATH_HELP.split()[:12]) in text
    assert "--report_to REPORT_TO" in text and " ".join(REPORT_TO_HELP.split()[:10]) in text
    assert "from which training is resumed" not in text  # Lightning's own --ckpt_path text is gone
