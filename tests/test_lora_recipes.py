"""configs/sft_lora.yaml, configs/dpo_lora.yaml and configs/sft_qlora.yaml as documented: the main job
(configs/sft.yaml, shortened) writes its export, then each LoRA recipe runs on it through the command line, on
``builtin:subtraction``. Every base parameter stays bit-identical to the export's file, the adapters are all that
trains (every ``lora_B``, which starts at zero, has moved), and the checkpoint holds only adapter tensors. The
measured run is ``benchmarks/lora_adapt.py`` (docs/lora.md)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.cli import CONFIGS, QUIET_FIT
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.models import load_model

BASE = Path("runs") / "sft" / "version_0" / "hf_model"  # relative to the working directory, as in the recipes
QUIET = [*QUIET_FIT, "--trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory where a shortened main job (30 steps of configs/sft.yaml) wrote its export."""
    work = tmp_path_factory.mktemp("lora_recipes")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        LitTrainerCLI(args=["fit", "--config", str(CONFIGS / "sft.yaml"), "--trainer.max_steps=30", *QUIET])
    finally:
        os.chdir(cwd)
    assert (work / BASE / "model.safetensors").exists()
    return work


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "steps"), [("sft_lora", 8), ("dpo_lora", 4), ("sft_qlora", 4)])
def test_lora_recipe_on_the_main_jobs_export_trains_only_the_adapters(
    main_job: Path, recipe: str, steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(main_job)
    base_file = main_job / BASE / "model.safetensors"
    digest = hashlib.sha256(base_file.read_bytes()).hexdigest()
    cli = LitTrainerCLI(
        args=["fit", "--config", str(CONFIGS / f"{recipe}.yaml"), f"--trainer.max_steps={steps}", *QUIET]
    )
    assert cli.trainer.global_step == steps
    assert cli.datamodule.dataset_source == "builtin:subtraction" and len(cli.datamodule.train_dataset) == 7600
    first = cli.datamodule.train_dataset[0]
    assert first.get("prompt_ids", first.get("input_ids"))[:3] == [ord(c) + 3 for c in "13-"]  # "13-88=" -> "-75"

    saved = load_file(str(base_file))
    if cli.model.is_quantized:  # QLoRA: the packed 4-bit base against the base file quantized afresh
        assert recipe == "sft_qlora" and type(cli.model.optimizers().optimizer).__name__ == "BnbAdamW"
        saved = {n: p.detach() for n, p in load_model(str(BASE), quantization="nf4").named_parameters()}
    network = cli.model.model.get_base_model()
    frozen = {n.replace(".base_layer", ""): p for n, p in network.named_parameters() if "lora_" not in n}
    assert frozen.keys() == saved.keys()
    for name, tensor in saved.items():
        assert not frozen[name].requires_grad and torch.equal(frozen[name].detach(), tensor), name
    assert hashlib.sha256(base_file.read_bytes()).hexdigest() == digest  # the export itself is not rewritten

    trainable = dict(cli.model.trainable_parameters())
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    lora_b = {n: p for n, p in trainable.items() if ".lora_B." in n}
    assert lora_b and all(p.detach().abs().sum() > 0 for p in lora_b.values())  # every adapter moved off zero

    checkpoint = torch.load(Path(cli.trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(".lora_" in k for k in checkpoint["state_dict"]) and len(checkpoint["state_dict"]) == len(trainable)
