"""Checkpoints of the former RLOOModule, a subclass of GRPOModule, still load and resume.

That class stored ``loss_type="grpo"`` among its hyper-parameters, and ``lit-trainer fit`` recorded GRPOModule's other
options (at their defaults) in the run record that ``--ckpt_path last`` compares. What such a run left is recorded in
``tests/data/rloo_legacy_record.json`` by ``tests/scripts/make_rloo_legacy_record.py`` (run on the code before the
split); the tests put it into a checkpoint written by today's code.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_trainer.modules.rloo import RLOOModule
from lit_trainer.rewards import arithmetic_reward

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
RECORD = json.loads((Path(__file__).parent / "data" / "rloo_legacy_record.json").read_text())
CONFIG = Path(__file__).parents[1] / "configs" / "rloo.yaml"
RETIRED_KEYS = {f"model.init_args.{name}" for name in RLOOModule.RETIRED_OPTIONS}


def with_legacy_hparams(path: Path, hparams: dict) -> Path:
    """Write today's RLOOModule (the recorded run's model: the tiny preset) with the former class's hyper-parameters."""
    module = RLOOModule("tiny", reward_funcs=[arithmetic_reward], beta=0.0)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu", devices=1)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path, weights_only=False)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["hyper_parameters"] = hparams
    torch.save(checkpoint, path)
    return path


def test_the_record_lists_the_retired_options_at_their_values():
    hparams, config = RECORD["hyper_parameters"], RECORD["lit_trainer_run"]["config"]
    assert hparams["loss_type"] == RLOOModule.RETIRED_OPTIONS["loss_type"] == "grpo"
    listed = {key.removeprefix("model.init_args."): config[key] for key in RETIRED_KEYS & config.keys()}
    assert len(listed) == len(RLOOModule.RETIRED_OPTIONS) - 1  # all but loss_type, which the class passed itself
    assert listed == {k: v for k, v in RLOOModule.RETIRED_OPTIONS.items() if k != "loss_type"}


@pytest.mark.parametrize("written_by", ["cli", "python"])
def test_a_former_rloo_checkpoint_loads(tmp_path, written_by):
    hparams = dict(RECORD["hyper_parameters"])
    if written_by == "python":  # no LightningCLI instantiator: Lightning calls RLOOModule(**hparams)
        hparams = {k: v for k, v in hparams.items() if not k.startswith("_")}
    path = with_legacy_hparams(tmp_path / "legacy.ckpt", hparams)
    module = RLOOModule.load_from_checkpoint(path, map_location="cpu")
    assert isinstance(module, RLOOModule) and "loss_type" not in module.hparams
    assert module.hparams.num_generations == hparams["num_generations"] == 8
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in module.state_dict().items())


def test_retired_options_are_unexpected_keywords_outside_a_checkpoint_load():
    with pytest.raises(TypeError, match="loss_type"):
        RLOOModule("tiny", reward_funcs=[arithmetic_reward], loss_type="grpo")


def test_ckpt_path_last_continues_a_run_recorded_with_the_retired_options(tmp_path, monkeypatch):
    from lit_trainer.cli import LitTrainerCLI

    monkeypatch.chdir(tmp_path)
    args = [
        "fit", "--config", str(CONFIG), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.val_check_interval", "null",
        "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(tmp_path),
        "--model.init_args.max_completion_length", "2", "--data.init_args.batch_size", "16",
    ]  # fmt: skip
    LitTrainerCLI(args=[*args, "--trainer.max_steps", "1"])
    path = tmp_path / "rloo" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)  # make it the former class's checkpoint
    recorded = RECORD["lit_trainer_run"]["config"]
    checkpoint["lit_trainer_run"]["config"].update({k: recorded[k] for k in RETIRED_KEYS & recorded.keys()})
    checkpoint["lit_trainer_run"]["finished"] = False  # as a run stopped by a signal before its max_steps
    checkpoint["hyper_parameters"]["loss_type"] = "grpo"
    torch.save(checkpoint, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = LitTrainerCLI(args=[*args, "--trainer.max_steps", "2", "--ckpt_path", "last"])
    assert cli.trainer.ckpt_path == str(path) and cli.trainer.global_step == 2  # continued, not started afresh
    assert not (tmp_path / "rloo" / "version_1").exists()
    assert not [w for w in caught if "configuration" in str(w.message)]  # RunIdentity: no retired key "changed"
