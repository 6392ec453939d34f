"""A disk that fills up during a save: the previous checkpoint stays the one `--ckpt_path last` continues, no
partial file or half-written export is left, and `lit-trainer` says in one line what failed and how to continue."""

from __future__ import annotations

import os
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.cli import CONFIGS, QUIET_FIT
from helpers.disk_full import fill_disk_at_checkpoint, fill_disk_at_safetensors
from helpers.models import tiny_llama
from lit_trainer.callbacks.hf_export import export_hf
from lit_trainer.callbacks.resume_choice import resolve_resume_checkpoint
from lit_trainer.checkpoint_io import AtomicCheckpointIO
from lit_trainer.cli import main
from lit_trainer.core.atomic import NoSpaceError

QUIET = [*QUIET_FIT, "--trainer.log_every_n_steps=1"]


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(256, 256)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _at_step(step: int):
    return lambda checkpoint, path: checkpoint.get("global_step") == step


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_and_no_partial_file(tmp_path: Path, monkeypatch):
    folder = tmp_path / "ckpt"
    trainer = pl.Trainer(
        max_steps=4,
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    failed = fill_disk_at_checkpoint(monkeypatch, _at_step(4))  # the final save: the disk fills halfway through
    with pytest.raises(NoSpaceError) as full:
        trainer.fit(Regressor(), DataLoader(TensorDataset(torch.randn(16, 256)), batch_size=4))
    assert failed == [str(folder / ".epoch=0-step=4.ckpt.partial")]
    assert sorted(os.listdir(folder)) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # no partial, no truncated file
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2  # the previous good `last`
    assert Path(resolve_resume_checkpoint(folder)).name in ("epoch=0-step=2.ckpt", "last.ckpt")
    message = str(full.value)
    assert "\n" not in message and message.startswith(f"Could not write the checkpoint {folder}/epoch=0-step=4.ckpt")
    assert f"no space left on device in {folder} (about " in message and " free)" in message
    # the size it names is its tensors' (the step-2 file holds the same tensors), short of the file by the pickle and
    # zip records: 257.0 KiB named, a 261.0 KiB file here (1.5%); 5% allows other torch versions' layouts
    needed = float(re.search(r"about ([\d.]+) KiB needed", message).group(1))
    written = (folder / "last.ckpt").stat().st_size / 1024
    assert needed == pytest.approx(written, rel=0.05), (needed, written)


def test_an_hf_export_that_does_not_fit_keeps_the_previous_export_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    model, target = tiny_llama(), tmp_path / "hf_model"
    export_hf(model, None, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    fill_disk_at_safetensors(monkeypatch)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(NoSpaceError, match=rf"^Could not write the HF export {target}: no space left on device in "):
        export_hf(model, None, target)
    assert sorted(os.listdir(tmp_path)) == ["hf_model"]  # no .hf_model.partial
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


@pytest.fixture
def sft_config(tmp_path, monkeypatch) -> str:
    """configs/sft.yaml with a checkpoint every 2 steps (the shipped one saves every 500)."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((CONFIGS / "sft.yaml").read_text())
    (periodic,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("ModelCheckpoint")]
    periodic["init_args"]["every_n_train_steps"] = 2
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    return "sft.yaml"


def _error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("lit-trainer: error:")]


@pytest.mark.slow
def test_cli_disk_full_at_the_final_save_says_so_in_one_line_and_last_continues(sft_config, tmp_path, capsys):
    args = ["fit", "--config", sft_config, "--trainer.max_steps", "4", *QUIET]
    checkpoints = Path("runs/sft/version_0/checkpoints")  # as the run names it: under the working directory
    with pytest.MonkeyPatch.context() as patch:
        fill_disk_at_checkpoint(patch, _at_step(4))
        with pytest.raises(SystemExit) as stopped:
            main(args)
    assert stopped.value.code == 1
    (line,) = _error_lines(capsys)
    assert line.startswith(f"lit-trainer: error: Could not write the checkpoint {checkpoints}/epoch=0-step=4.ckpt: ")
    assert f"no space left on device in {checkpoints} (about " in line
    command = f"lit-trainer fit --config {sft_config} --trainer.max_steps 4 {' '.join(QUIET)} --ckpt_path last"
    assert f"Free space, then continue: {command} (resumes from {checkpoints}/last.ckpt at step 2)." in line
    assert sorted(os.listdir(checkpoints)) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert not (checkpoints.parent / "hf_model").exists()
    # the command it names continues the run from step 2 and finishes it
    main(args + ["--ckpt_path", "last"])
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 4
    assert (checkpoints.parent / "hf_model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_cli_disk_full_at_the_export_names_the_checkpoint_that_finishes_the_run(sft_config, tmp_path, capsys):
    args = ["fit", "--config", sft_config, "--trainer.max_steps", "4", *QUIET]
    run = Path("runs/sft/version_0")
    with pytest.MonkeyPatch.context() as patch:
        fill_disk_at_safetensors(patch)
        with pytest.raises(SystemExit):
            main(args)
    (line,) = _error_lines(capsys)
    assert line.startswith(f"lit-trainer: error: Could not write the HF export {run}/hf_model: no space left on ")
    # step 4 ends the run, so `last` would pass it over: the command names the checkpoint
    newest = resolve_resume_checkpoint(run / "checkpoints")
    assert torch.load(newest, weights_only=True)["global_step"] == 4
    assert f"--ckpt_path {newest} (trains nothing more and writes what is missing (the HF export))." in line
    assert not (run / "hf_model").exists() and not (run / ".hf_model.partial").exists()
    main(args + ["--ckpt_path", newest])
    assert (run / "hf_model" / "model.safetensors").is_file()
