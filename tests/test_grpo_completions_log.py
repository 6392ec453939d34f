"""GRPOModule's ``log_completions`` / ``num_completions_to_print``: the completions table on the console, in the CSV
logger's folder, in TensorBoard and through any logger's ``log_table``."""

from __future__ import annotations

import csv
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from datasets import Dataset
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from test_grpo_module import QUIET as GRPO_QUIET
from test_grpo_module import length_reward

from helpers.models import tiny_llama
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.modules.online_rl._completion_table import markdown_table, render_text, write_completion_table

QUIET = {k: v for k, v in GRPO_QUIET.items() if k != "logger"}  # a logger is passed per test


class TableLogger(Logger):
    """A logger with only ``log_table`` (as WandbLogger and a Trackio logger have): records the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict] = []

    @property
    def name(self) -> str:
        return "tables"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_table(self, key: str, columns: list, data: list, step: int | None = None) -> None:
        self.tables.append({"key": key, "columns": columns, "data": data, "step": step})


def test_completions_table_goes_to_every_logger_and_the_console(tmp_path, capsys):
    csv_logger, tb_logger, table_logger = CSVLogger(tmp_path), TensorBoardLogger(tmp_path), TableLogger()
    module = GRPOModule(
        tiny_llama(0, eos_bias=3.0), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward],
        num_generations=4, max_completion_length=4, learning_rate=1e-3, generation_seed=0, log_completions=True,
        num_completions_to_print=2,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(8)]})
    dm = PromptDataModule(
        tokenizer=transformers.ByT5Tokenizer(), dataset=prompts, batch_size=8, max_length=16, val_size=0,
        sampling="sequential",
    )  # fmt: skip
    trainer = L.Trainer(max_steps=2, log_every_n_steps=1, logger=[csv_logger, tb_logger, table_logger], **QUIET)
    trainer.fit(module, datamodule=dm)

    columns = ["prompt", "completion", "length_reward", "advantage"]
    with open(tmp_path / "lightning_logs" / "version_0" / "completions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", *columns]
    # each logging step: the latest round's 8 rows, at the step of that step's metrics (Lightning's: 0, 1)
    assert [r["step"] for r in rows] == ["0"] * 8 + ["1"] * 8
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f) if r.get("train_loss")] == ["0", "1"]
    assert {r["prompt"] for r in rows[:8]} == {"10+11=", "11+11="}
    # the advantages are the group-normalised rewards of the logged reward column (TRL: std + 1e-4)
    rewards = torch.tensor([float(r["length_reward"]) for r in rows], dtype=torch.float64).reshape(-1, 4)
    expected = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    logged = torch.tensor([float(r["advantage"]) for r in rows], dtype=torch.float64).reshape(-1, 4)
    torch.testing.assert_close(logged, expected, rtol=1e-5, atol=1e-5)  # float32 advantages written as text
    assert rewards.std() > 0  # the check can fail: the rewards vary

    assert [t["step"] for t in table_logger.tables] == [0, 1]
    assert table_logger.tables[0]["key"] == "completions" and table_logger.tables[0]["columns"] == columns
    assert [str(r[0]) for r in table_logger.tables[1]["data"]] == [r["prompt"] for r in rows[8:]]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_logger.log_dir))
    events.Reload()
    assert "completions/text_summary" in events.Tags()["tensors"]
    texts = events.Tensors("completions/text_summary")
    assert [e.step for e in texts] == [0, 1]
    assert texts[0].tensor_proto.string_val[0].decode().startswith("| prompt | completion | length_reward |")

    out = capsys.readouterr().out
    assert "Step 0" in out and "Step 1" in out and "length_reward" in out


def test_table_writers_by_hand(tmp_path, capsys):
    assert render_text([{"role": "user", "content": "2+2="}]) == "user: 2+2="
    assert (
        markdown_table(["a", "b"], [["x|y", 0.5], ["l1\nl2", 2]])
        == "| a | b |\n|---|---|\n| x\\|y | 0.5 |\n| l1<br>l2 | 2 |"
    )
    logger = CSVLogger(tmp_path)
    write_completion_table([logger], ["prompt", "r"], [["p1", 1.0], ["p2", 2.0], ["p3", 3.0]], 7, num_to_print=1)
    write_completion_table([logger], ["prompt", "r"], [["p4", 4.0]], 8, num_to_print=None)
    with open(tmp_path / "lightning_logs" / "version_0" / "completions.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "prompt", "r"], ["7", "p1", "1.0"], ["7", "p2", "2.0"],
                                       ["7", "p3", "3.0"], ["8", "p4", "4.0"]]  # fmt: skip
    out = capsys.readouterr().out
    assert sum(p in out for p in ("p1", "p2", "p3")) == 1 and "p4" in out  # one row of step 7 printed
    with pytest.raises(ValueError, match="new log directory"):
        write_completion_table([logger], ["other"], [["x"]], 9, console=False)
    unique = CSVLogger(tmp_path, name="unique")
    rows = [["p1", 1.0], ["p2", 2.0], ["p1", 3.0], [[{"role": "user", "content": "q"}], 4.0]]
    rows.append([[{"role": "user", "content": "q"}], 5.0])  # the same conversation again
    write_completion_table([unique], ["prompt", "r"], rows, 3, console=False, unique_prompts=True)
    with open(tmp_path / "unique" / "version_0" / "completions.csv", newline="") as f:
        assert [r[1:] for r in csv.reader(f)][1:] == [
            ["p1", "1.0"],
            ["p2", "2.0"],
            ["[{'role': 'user', 'content': 'q'}]", "4.0"],
        ]


def test_num_completions_to_print_is_validated():
    with pytest.raises(ValueError, match=r"num_completions_to_print=0.*>= 1, or None"):
        GRPOModule(tiny_llama(0), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward],
                   num_completions_to_print=0)  # fmt: skip
