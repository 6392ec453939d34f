"""The default recipe learns for real at a seed other than the shipped one: configs/sft.yaml reaches >= 95% greedy exact
match on 500 held-out problems within its 2,000 steps at seed 1.

Seed 1 is the slowest of seeds 1-10 in the measurement behind docs/quickstart.md#at-every-seed (`python
benchmarks/sft_seeds.py --seeds 1 2 3 4 5 6 7 8 9 10`, AMD EPYC, one thread per run): 0.120 / 0.882 / 0.972 / 0.984 at
steps 500 / 1,000 / 1,500 / 2,000, where the other nine passed 97% by step 1,500 or earlier and ended at >= 0.990.
The bound (95%, not the 97% every seed reached) is a margin from that spread: once learned, exact match still moves by
1-2 points between evaluations, and another CPU's rounding moves the step at which a seed learns by some hundreds of
steps (before the recipe's fix, by thousands). The run stops at the first validation at or above 97% (the steps after
it only cost suite time); it is the slowest test of the suite (the suite starts it first) and runs the shipped config
as is, through the CLI, with only the seed given and the progress bar turned off."""

from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from helpers.readme import run_readme_generate
from lit_trainer.callbacks import HFExport
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.data import builtin

pytestmark = pytest.mark.slow


SFT = Path(__file__).resolve().parents[1] / "configs" / "sft.yaml"


class StopOnceLearned(Callback):
    """Ends the run at the first validation at or above 97% exact match: the test's question is whether the recipe
    gets there within its 2,000 steps; the steps after it (500 of them at seed 1) only cost suite time.
    The run up to that validation is the shipped recipe's, step for step (a callback that only reads metrics)."""

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if float(trainer.callback_metrics.get("val_exact_match", 0.0)) >= 0.97:
            trainer.should_stop = True


@pytest.mark.parametrize("seed", [1])
def test_default_sft_config_reaches_95_percent_exact_match(seed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(SFT), "--seed_everything", str(seed), "--trainer.enable_progress_bar", "false"]
    cli = LitTrainerCLI(args=args, trainer_defaults={"callbacks": [StopOnceLearned()]})
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.max_steps == 2000 and cli.trainer.global_step <= 2000
    assert float(metrics["val_exact_match"]) >= 0.95, dict(metrics)
    assert float(metrics["val_token_accuracy"]) > 0.95
    # the README's generate example, run as written on the export (plain transformers), answers held-out problems
    export = next(c.last_export for c in cli.trainer.callbacks if isinstance(c, HFExport))
    problems = builtin.addition_problems("validation")[:20]
    answers = [run_readme_generate(export, f"{a}+{b}=") for a, b in problems]
    assert sum(text == f"{a}+{b}={a + b}" for text, (a, b) in zip(answers, problems)) >= 17, answers
    # the untrained model is at 0: check the logged history rose over the run (a validation every 500 steps)
    rows = (tmp_path / "runs" / "sft" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    column = header.index("val_exact_match")
    history = [float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]]
    assert len(history) == cli.trainer.global_step // 500 and history[0] < history[-1]
