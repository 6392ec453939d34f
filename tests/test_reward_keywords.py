"""GRPO reward functions get TRL's keywords: ``trainer_state``, ``log_metric`` and ``log_extra``."""

from __future__ import annotations

import csv
from typing import Any

import lightning as L
import transformers
from lightning.pytorch.loggers import CSVLogger
from test_grpo_module import QUIET, data, grpo


class CurriculumReward:
    """A TRL-style reward: reads the trainer state and logs a metric and a per-completion column."""

    __name__ = "curriculum"

    def __init__(self) -> None:
        self.states: list[tuple[int, float, int, int, bool]] = []

    def __call__(
        self,
        completions: list,
        completion_ids: list,
        trainer_state: Any,
        log_metric: Any,
        log_extra: Any,
        **kwargs: Any,
    ) -> list[float]:
        assert isinstance(trainer_state, transformers.TrainerState)
        self.states.append(
            (
                trainer_state.global_step,
                trainer_state.epoch,
                trainer_state.max_steps,
                trainer_state.num_train_epochs,
                trainer_state.is_world_process_zero,
            )
        )
        log_metric("curriculum/stage", 10.0 + trainer_state.global_step)
        log_metric("curriculum/stage", 12.0 + trainer_state.global_step)  # two calls in one scoring: their mean
        log_extra("n_ids", [len(ids) for ids in completion_ids])
        log_extra("note", ["text"] * len(completions))  # not a number: kept on the module only
        return [float(len(ids)) for ids in completion_ids]


def test_trl_reward_keywords_reach_the_function_and_the_logs(tmp_path):
    reward = CurriculumReward()
    module = grpo(reward_funcs=[reward])
    # 12 prompts x 4 generations / batch 16 (one round per optimizer step): 3 steps per epoch, stop after 4
    trainer = L.Trainer(max_steps=4, log_every_n_steps=1, **{**QUIET, "logger": CSVLogger(tmp_path, name="r")})
    trainer.fit(module, datamodule=data(12, batch_size=16))
    assert [s[0] for s in reward.states] == [0, 1, 2, 3]  # global_step = optimizer steps done when scoring
    assert [round(s[1], 4) for s in reward.states] == [0.3333, 0.6667, 1.0, 1.3333]  # HF: epoch + (batch+1)/batches
    assert {s[2:] for s in reward.states} == {(4, 2, True)}  # max_steps; epochs as HF: ceil(4 steps / 3 per epoch)
    with open(tmp_path / "r" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("curriculum/stage")]
    assert [float(r["curriculum/stage"]) for r in rows] == [11.0, 12.0, 13.0, 14.0]
    assert all(float(r["extra/n_ids"]) > 0 for r in rows)
    extra = module.reward_extra
    assert set(extra) == {"n_ids", "note"} and len(extra["note"]) == 16 and extra["note"][0] == "text"


def test_extra_keywords_go_to_functions_that_take_them():
    from lit_trainer.rewards import call_reward_functions

    seen: dict[str, Any] = {}

    def strict(prompts, completions, completion_ids, answer):  # written before the keywords existed
        return [1.0 for _ in completions]

    def named(completions, trainer_state, **columns):
        seen["named"] = (trainer_state, sorted(columns))
        return [2.0 for _ in completions]

    extra = {"trainer_state": "state", "log_metric": print, "log_extra": print}
    rewards = call_reward_functions([strict, named], ["1+1="], ["2"], [[53]], {"answer": ["2"]}, extra_kwargs=extra)
    assert rewards.tolist() == [[1.0, 2.0]]
    assert seen["named"] == ("state", ["answer", "completion_ids", "log_extra", "log_metric", "prompts"])


def test_metrics_logged_by_reward_functions_in_validation(tmp_path):
    reward = CurriculumReward()
    module = grpo(reward_funcs=[reward])
    options = {**QUIET, "limit_val_batches": 1, "logger": CSVLogger(tmp_path, name="v")}
    trainer = L.Trainer(max_steps=1, log_every_n_steps=1, val_check_interval=1, **options)
    trainer.fit(module, datamodule=data(16, batch_size=16, val_size=4))
    with open(tmp_path / "v" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val_curriculum/stage")]
    assert [float(r["val_curriculum/stage"]) for r in rows] == [12.0]  # scored after step 1: mean of 11 and 13
    assert float(rows[0]["val_extra/n_ids"]) > 0
