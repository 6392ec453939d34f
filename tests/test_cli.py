"""The main job through the real console script, and the CLI's defaults."""

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.ddp import run_lit_trainer
from lit_trainer.callbacks.jit_checkpoint import JITCheckpointExit
from lit_trainer.checkpoint_io import write_sentinel
from lit_trainer.cli import LitTrainerCLI

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "configs" / "sft.yaml"
FAST = [
    "--trainer.max_steps",
    "12",
    "--trainer.val_check_interval",
    "6",
    "--trainer.log_every_n_steps",
    "3",
    "--data.init_args.eval_batch_size",
    "100",
    "--trainer.limit_val_batches",
    "1",
]


@pytest.mark.slow
def test_main_job_end_to_end_in_subprocess(tmp_path):
    proc = run_lit_trainer("fit", "--config", SFT, *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "sft" / "version_0"
    # stdout is a pipe: plain progress lines instead of a bar, then the final metrics table and the run folder
    assert "step 12/12 | epoch 0 | loss " in proc.stdout, proc.stdout
    assert "Final validation metrics (step 12):" in proc.stdout and "val_exact_match" in proc.stdout
    assert "Run folder: runs/sft/version_0" in proc.stdout
    for noise in ("args parameter", "LeafSpec", "litlogger", "Epoch 0/-2", "v_num on_0", "v_num: on_0"):
        assert noise not in proc.stdout + proc.stderr, noise
    metrics = (run / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    for key in (
        "train_loss",
        "learning_rate",
        "grad_norm",
        "tokens_per_sec",
        "padding_fraction",
        "val_loss",
        "val_exact_match",
        "val_perplexity",
        "val_token_accuracy",
    ):
        assert key in header, key
    assert (run / "config.yaml").exists()
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())  # TensorBoard in the same dir
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 12
    # the HF export reloads with plain transformers and gives the checkpoint's logits
    export = run / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert (export / "model.safetensors").exists()
    ids = torch.tensor([tokenizer("37+45=")["input_ids"]])
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    reference = AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(state, strict=False)
    reference.tie_weights()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_print_config_is_valid_input(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        LitTrainerCLI(args=["fit", "--config", str(SFT), "--print_config"])
    printed = capsys.readouterr().out
    config = yaml.safe_load(printed)
    assert config["model"]["class_path"].endswith("CausalLMModule")
    assert "tokenizer" not in config["data"]["init_args"]  # a link target: derived from model.init_args.model
    assert config["seed_everything"] == 1234
    (tmp_path / "printed.yaml").write_text(printed)
    assert config["trainer"]["max_steps"] == 2000 and config["trainer"]["gradient_clip_val"] == 1.0
    cli = LitTrainerCLI(
        args=["fit", "--config", "printed.yaml", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"]
    )
    assert cli.trainer.global_step == 2
    assert cli.model.hparams.learning_rate == pytest.approx(0.003)  # tolerance: a YAML float read back
    assert cli.datamodule.tokenizer_source == "tiny"


def test_fit_without_a_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="Lightning would stop after an arbitrary 1000 epochs"):
        LitTrainerCLI(args=["fit", "--config", str(SFT), "--trainer.max_steps", "-1", "--trainer.max_epochs", "null"])


def test_default_seed_is_fixed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(SFT.read_text())
    config.pop("seed_everything")
    (tmp_path / "noseed.yaml").write_text(yaml.safe_dump(config))
    cli = LitTrainerCLI(args=["--config", "noseed.yaml"], run=False)
    assert cli.config["seed_everything"] == 1234


def _fit(args, *, every=500, extra_callbacks=()):
    config = yaml.safe_load(SFT.read_text())
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = every
    config["trainer"]["callbacks"] += list(extra_callbacks)
    Path("variant.yaml").write_text(yaml.safe_dump(config))
    return LitTrainerCLI(
        args=[
            "fit",
            "--config",
            "variant.yaml",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.val_check_interval",
            "1000",
            "--trainer.limit_val_batches",
            "0",
            *args,
        ]
    )


@pytest.mark.slow
def test_resume_policy_last_picks_newest_complete_and_fresh_never_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the first run is stopped by Ctrl-C at step 4 of 8 (a finished run is never continued by `last`)
    ctrl_c = {"class_path": "helpers.signals.SignalAt", "init_args": {"step": 4, "signal_name": "SIGINT"}}
    with pytest.raises(JITCheckpointExit):
        _fit(["--trainer.max_steps", "8"], every=2, extra_callbacks=[ctrl_c])
    ckpts = tmp_path / "runs" / "sft" / "version_0" / "checkpoints"
    assert (ckpts / "last.ckpt").exists() and (ckpts / "last-jit-epoch=0-step=4.ckpt").exists()
    # a fresh run (no --ckpt_path) starts from step 0 even though checkpoints exist
    fresh = _fit(["--trainer.max_steps", "1"])
    assert fresh.trainer.global_step == 1
    # the fresh run's checkpoint (version_1, step 1) is the newest: mark it incomplete, so `last` must skip it
    # (with a warning naming it) and resume from the first run's step-4 checkpoint
    newer = tmp_path / "runs" / "sft" / "version_1" / "checkpoints"
    write_sentinel(newer, "last.ckpt", step=1)
    with pytest.warns(UserWarning, match="last.ckpt"):
        resumed = _fit(["--trainer.max_steps", "6", "--ckpt_path", "last"])
    assert Path(resumed.trainer.ckpt_path).resolve().parent == ckpts.resolve()
    assert torch.load(resumed.trainer.ckpt_path, weights_only=True)["global_step"] == 4
    assert resumed.trainer.global_step == 6


def test_fresh_run_refuses_lightnings_silent_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exc").mkdir()
    torch.save({"global_step": 3}, tmp_path / "exc" / "on_exception.ckpt")
    on_exception = {
        "class_path": "lightning.pytorch.callbacks.OnExceptionCheckpoint",
        "init_args": {"dirpath": str(tmp_path / "exc")},
    }
    with pytest.raises(ValueError, match="on_exception.ckpt"):
        _fit(["--trainer.max_steps", "1"], extra_callbacks=[on_exception])
