"""Checkpoints written before the reference model became a component still load: the files in ``tests/data`` were
saved by the earlier code (``tests/scripts/make_preference_checkpoints.py``), and loading them through Lightning's
``load_from_checkpoint`` must restore the same hyperparameters, every ``ref_model.*`` weight and the precomputed
reference log-probs."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.models import tiny_llama
from lit_trainer import DPOModule, KTOModule

DATA = Path(__file__).resolve().parent / "data"


def _saved(name: str) -> dict:
    return torch.load(DATA / name, map_location="cpu", weights_only=False)


def _assert_restored(module: torch.nn.Module, checkpoint: dict) -> None:
    assert dict(module.hparams) == checkpoint["hyper_parameters"]
    state = module.state_dict()
    assert set(state) == set(checkpoint["state_dict"])
    for name, tensor in checkpoint["state_dict"].items():
        assert torch.equal(state[name], tensor), name


def test_a_dpo_checkpoint_with_a_synced_reference_copy_loads():
    checkpoint = _saved("dpo_copy_sync.ckpt.pt")
    module = DPOModule.load_from_checkpoint(
        DATA / "dpo_copy_sync.ckpt.pt", model=tiny_llama(seed=3, hidden=8), weights_only=False
    )
    _assert_restored(module, checkpoint)
    assert any(k.startswith("ref_model.") for k in checkpoint["state_dict"])
    assert module.reference.mode == "copy"
    assert (module.reference.sync_enabled, module.reference.sync_steps, module._loss_options["beta"]) == (True, 4, 0.2)


def test_a_dpo_checkpoint_with_precomputed_reference_logps_loads():
    checkpoint = _saved("dpo_precomputed.ckpt.pt")
    module = DPOModule.load_from_checkpoint(
        DATA / "dpo_precomputed.ckpt.pt", model=tiny_llama(seed=3, hidden=8), weights_only=False
    )
    _assert_restored(module, checkpoint)
    assert not any(k.startswith("ref_model.") for k in checkpoint["state_dict"])
    restored = module.reference.precomputed.restored["train"]
    assert restored["key"] == "k" * 40 and restored["data"] == "data-fp"
    assert restored["chosen"].tolist() == [-1.0, -2.0] and restored["rejected"].tolist() == [-3.0, -4.0]


def test_a_kto_checkpoint_with_a_separate_reference_loads():
    checkpoint = _saved("kto_separate.ckpt.pt")
    module = KTOModule.load_from_checkpoint(
        DATA / "kto_separate.ckpt.pt", model=tiny_llama(seed=3, hidden=8), weights_only=False
    )
    _assert_restored(module, checkpoint)  # the separate reference's weights, into the frozen copy built on load
    assert module._loss_options["desirable_weight"] == 2.0
