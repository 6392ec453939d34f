"""Vision-language SFT (``tiny-vl``) with the training features: the vision tower frozen or trained (full fine-tuning
and LoRA), gradient checkpointing with chunked logits, exact resume, and 2-rank DDP. FSDP2 is checked in
``tests/test_fsdp.py`` (one case inside its single launch of ``tests/scripts/fsdp_train.py``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ddp_vision import vision_datamodule, vision_model  # tests/scripts
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.accumulation import calibrated
from helpers.rounding import Rounding, relative_l2
from lit_trainer.callbacks import ExactResume
from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.modules.base import _vision_tower
from lit_trainer.modules.causal_lm import CausalLMModule

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
TOWER, PROJECTOR = "model.vision_tower.", "model.multi_modal_projector."


def _trainable(module: CausalLMModule) -> dict[str, int]:
    """Trainable values per part: ``tower``, ``projector``, ``language`` (peft's prefixes removed)."""
    counts = {"tower": 0, "projector": 0, "language": 0}
    for name, param in module.model.named_parameters():
        if param.requires_grad:
            name = name.removeprefix("base_model.model.")
            part = "tower" if name.startswith(TOWER) else "projector" if name.startswith(PROJECTOR) else "language"
            counts[part] += param.numel()
    return counts


def test_vision_tower_is_frozen_unless_asked_and_lora_targets_the_language_model() -> None:
    model = vision_model()
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith(TOWER))
    projector = sum(p.numel() for n, p in model.named_parameters() if n.startswith(PROJECTOR))
    full = CausalLMModule(copy.deepcopy(model))
    assert _trainable(full) == {"tower": 0, "projector": projector, "language": 618_880 - tower - projector}
    assert _trainable(CausalLMModule(copy.deepcopy(model), train_vision_tower=True))["tower"] == tower

    lora = CausalLMModule(copy.deepcopy(model), peft_config=LORA)
    names = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    # all-linear: adapters on the language model only; the projector trains fully (peft's modules_to_save)
    assert not any("vision_tower" in n for n in names)
    assert {n for n in names if "projector" in n} == {
        f"base_model.model.model.multi_modal_projector.modules_to_save.default.{n}"
        for n in ("linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias")
    }
    assert all("lora_" in n for n in names if "projector" not in n) and _trainable(lora)["language"] > 0
    # with train_vision_tower=True the tower gets adapters too (CLIP's linear layers), its base weights stay frozen
    trained = CausalLMModule(copy.deepcopy(model), peft_config=LORA, train_vision_tower=True)
    tower_names = [n for n, p in trained.model.named_parameters() if p.requires_grad and "vision_tower" in n]
    assert tower_names and all("lora_" in n for n in tower_names)
    # a config that sets modules_to_save decides alone: [] leaves the projector to target_modules (adapters here)
    own = CausalLMModule(copy.deepcopy(model), peft_config={**LORA, "modules_to_save": []})
    assert any("multi_modal_projector.linear_1.lora_A" in n for n, p in own.model.named_parameters() if p.requires_grad)
    # the caller's exclude_modules are kept beside the tower's
    kept = CausalLMModule(copy.deepcopy(model), peft_config={**LORA, "exclude_modules": ["down_proj"]})
    adapters = [n for n, _ in kept.model.named_parameters() if "lora_" in n]
    assert adapters and not any("down_proj" in n or "vision_tower" in n for n in adapters)


def test_train_vision_tower_is_refused_where_it_cannot_apply() -> None:
    from helpers.models import tiny_llama

    with pytest.raises(ValueError, match=r"train_vision_tower=True.*LlamaForCausalLM is text-only.*remove"):
        CausalLMModule(tiny_llama(seed=0), train_vision_tower=True)
    with pytest.raises(ValueError, match=r"no adapter in the vision tower \(model.vision_tower\).*modules_to_save"):
        CausalLMModule(vision_model(), peft_config={**LORA, "target_modules": ["gate_proj"]}, train_vision_tower=True)
    assert _vision_tower.check_option(torch.nn.Linear(2, 2), False) is False  # text-only, default: nothing to do


def _batch(count: int = 6) -> dict[str, torch.Tensor]:
    dm = vision_datamodule(count, count=count)
    dm.setup("fit")
    return dm._collate([dm.train_dataset[i] for i in range(count)], True)


def _loss_and_grads(module: CausalLMModule, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.model.zero_grad()
    loss, _ = module.compute_loss(dict(batch), None)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_gradient_checkpointing_and_chunked_logits_with_images_equal_the_plain_path() -> None:
    """Activation checkpointing (vision tower and language model) with chunked logits (7-token chunks) against full
    logits without checkpointing, the tower trained so that its gradients are compared too."""
    batch = _batch()
    assert batch["pixel_values"].shape[0] == 6  # rows with 0, 1 and 2 images
    model = vision_model()
    options = {"train_vision_tower": True}
    plain = CausalLMModule(copy.deepcopy(model), chunked_logits="off", **options)
    fast = CausalLMModule(
        copy.deepcopy(model), gradient_checkpointing=True, chunked_logits="on", logits_chunk_size=7, **options
    )
    assert fast.model.is_activation_checkpointing and fast._chunked() and not plain._chunked()
    loss, grads = _loss_and_grads(plain, batch)
    got_loss, got = _loss_and_grads(fast, batch)
    assert any(n.startswith(TOWER) for n in got) and set(got) == set(grads)
    # calibration: the plain path in float64 (tests/helpers/rounding.py); a real mistake: the gradient of the same
    # rows with blank images (the images not reaching the loss)
    double = CausalLMModule(copy.deepcopy(model).double(), chunked_logits="off", **options)
    loss64, grads64 = _loss_and_grads(double, {**batch, "pixel_values": batch["pixel_values"].double()})
    blank = _loss_and_grads(plain, {**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])})[1]
    rounding = Rounding.of(grads, grads64, what="checkpointed+chunked gradient")
    rounding.check(got, grads, mistake=relative_l2(blank, grads))
    # the loss: measured |float32 - float64| ~1e-7 relative; bound 4x that scale (at least 4 float32 units)
    losses = Rounding.of({"l": loss}, {"l": loss64}, what="checkpointed+chunked loss")
    losses.check({"l": got_loss}, {"l": loss}, mistake=1e-3 * float(loss))


def _resume_run(root: Path, ckpt: Path | None = None, save: bool = False) -> CausalLMModule:
    """LoRA (adapters on the language model, the projector fully trained, the tower frozen): 4 optimizer steps of
    2 micro-batches, random order; ``save``: a checkpoint every 2 steps."""
    module = CausalLMModule(vision_model(), peft_config=LORA, learning_rate=1e-2, scheduler="constant")
    callbacks: list = [ExactResume()]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=2, save_top_k=-1))
    pl.seed_everything(0)
    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module, datamodule=vision_datamodule(2, count=12, sampling="random"), ckpt_path=ckpt)
    return module


@pytest.mark.slow
def test_lora_vision_run_resumed_mid_run_ends_bit_equal(tmp_path: Path) -> None:
    full = _resume_run(tmp_path, save=True)
    path = tmp_path / "ck" / "epoch=0-step=2.ckpt"
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert any("multi_modal_projector.modules_to_save" in k for k in saved)  # the projector copy is trained state
    assert not any("vision_tower" in k for k in saved)  # adapter-only checkpoint: the frozen tower is not saved
    resumed = _resume_run(tmp_path, ckpt=path)
    start = CausalLMModule(vision_model(), peft_config=LORA).state_dict()
    changed = 0
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
        changed += not torch.equal(a, start[name])
    assert changed > 0  # the run trained something


@pytest.mark.ddp
def test_ddp_vision_gradients_equal_the_one_process_full_batch(ddp_world) -> None:
    tmp_path = ddp_world.part("vision")  # tests/scripts/ddp_vision.py, run in the shared 2-rank world
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [n for _, n in ranks[0]["seen"]] != [n for _, n in ranks[1]["seen"]]  # images differ between ranks
    assert 0 in [n for _, n in ranks[1]["seen"][:2]]  # an image-free micro-batch in a window that all-reduces
    dm = vision_datamodule(2)
    dm.setup("fit")
    rows = {tuple(dm._collate([dm.train_dataset[i]], True)["input_ids"][0].tolist()): i for i in range(16)}
    model = vision_model()

    def gradient(network: torch.nn.Module, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = dm._collate([dm.train_dataset[i] for i in indices], True)
        dtype = next(network.parameters()).dtype
        out = network(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"].to(dtype),
        )
        network.zero_grad()
        causal_lm_loss(out.logits, batch["labels"]).backward()
        tower = [n for n, _ in network.named_parameters() if n.startswith(TOWER)]
        return {n: p.grad.detach().clone() for n, p in network.named_parameters() if n not in tower}

    for step in (0, 1):
        trained = []
        for rank in ranks:
            for ids, _ in rank["seen"][2 * step : 2 * step + 2]:
                trained += [rows[tuple(row[: int((row != 0).nonzero().max()) + 1].tolist())] for row in ids]
        assert sorted(trained) == list(range(8 * step, 8 * step + 8))
        reference = calibrated(
            lambda m, rows_=trained: gradient(m, rows_),
            model,
            mistake=lambda m, rows_=trained: gradient(m, rows_[:-1]),  # a row lost at a rank or window boundary
            what=f"DDP vision gradient, step {step + 1}",
        )
        for rank in ranks:
            got = rank["grads"][step]
            assert not any(n.startswith(TOWER) for n in got)  # the frozen tower has no gradient
            reference.check(got)
