"""What the console shows while and after a run: the Rich bar counts optimizer steps toward ``max_steps`` (not the
epoch's micro-batches), GRPO/RLOO show their mean reward beside the loss, the bar's live display is stopped before the
end-of-fit lines are printed, and the final metrics table fits an 80-column terminal with every name and value."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
from datasets import Dataset
from rich.console import Console

from lit_trainer import CausalLMModule, GRPOModule, RLOOModule
from lit_trainer.callbacks.progress import FinalMetrics, RunProgressBar, metrics_table
from lit_trainer.data import PromptDataModule, SFTDataModule
from lit_trainer.models import build_tokenizer
from lit_trainer.rewards import arithmetic_reward

LONG_NAME = "val_rewards/" + "runs_reward_model_trained_on_the_addition_pairs_" * 2 + "version_0_hf_model/mean"
METRICS = {"val_loss": 0.5, "val_exact_match": 0.956, LONG_NAME: 0.123456, "val_rewards/margins": -12.25}


class LiveAtFitEnd(L.Callback):
    """Records whether the bar's live display is still running when ``on_fit_end`` prints."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.live = trainer.progress_bar_callback.progress.live.is_started


def _sft_data() -> SFTDataModule:
    rows = Dataset.from_dict({"prompt": ["1+2=", "2+2=", "3+4=", "5+1="] * 4, "completion": ["3", "4", "7", "6"] * 4})
    return SFTDataModule(tokenizer=build_tokenizer(), dataset=rows, val_size=0, batch_size=2)


def test_rich_bar_counts_optimizer_steps_and_stops_before_the_final_lines():
    bar, probe = RunProgressBar(), LiveAtFitEnd()
    trainer = L.Trainer(
        max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[bar, probe],
    )  # fmt: skip
    trainer.fit(CausalLMModule("tiny", tokenizer=build_tokenizer()), datamodule=_sft_data())
    (task,) = [t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id]
    assert (task.completed, task.total) == (3, 3)  # Lightning's own bar: 6/3 (six micro-batches)
    assert probe.live is False


@pytest.mark.parametrize("module_class", [GRPOModule, RLOOModule])
def test_rl_progress_bar_shows_the_mean_reward_beside_the_loss(module_class):
    rows = Dataset.from_dict({"prompt": ["1+2=", "2+2="] * 4, "answer": ["3", "4"] * 4})
    data = PromptDataModule(tokenizer=build_tokenizer(), dataset=rows, val_size=0, batch_size=4, max_length=16)
    module = module_class(
        "tiny", tokenizer=build_tokenizer(), reward_funcs=[arithmetic_reward], num_generations=2,
        max_completion_length=3, beta=0.0,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=2, log_every_n_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    shown = trainer.progress_bar_metrics
    assert {"loss", "reward", "tok/s"} <= shown.keys()
    assert shown["reward"] == pytest.approx(float(trainer.logged_metrics["reward"]))


def _rows(text: str) -> list[tuple[str, str]]:
    """``(name, value)`` per table row: a folded name continues on lines without a value."""
    rows: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((parts[0], parts[1]))
        elif len(parts) == 1 and rows:
            rows[-1] = (rows[-1][0] + parts[0], rows[-1][1])
    return rows


def test_metrics_table_fits_80_columns_with_every_name_and_value():
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(metrics_table(METRICS))
    text = console.file.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert _rows(text) == [(name, f"{value:.4g}") for name, value in sorted(METRICS.items())]


def test_final_metrics_print_fits_an_80_column_terminal(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    final = FinalMetrics()
    final.metrics, final.step = METRICS, 7
    final.on_fit_end(SimpleNamespace(log_dir="runs/x/version_0", is_global_zero=True), None)
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert max(len(line) for line in lines) <= 80, printed
    table = printed.split("Final validation metrics (step 7):\n", 1)[1].split("Run folder:", 1)[0]
    assert _rows(table) == [(name, f"{value:.4g}") for name, value in sorted(METRICS.items())]
