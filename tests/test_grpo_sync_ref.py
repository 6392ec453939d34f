"""GRPOModule's ``sync_ref_model`` (TR-DPO for the KL reference, shared with DPOModule): the mixing schedule against
TRL 1.16's own SyncRefModelCallback, the option checks, and exact resume of the synced reference."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import transformers
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from test_grpo_module import QUIET, length_reward

from helpers.models import tiny_llama
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.modules.base._ref_sync import ReferenceSyncMixin
from lit_trainer.modules.dpo import DPOModule
from lit_trainer.modules.grpo import GRPOModule

SyncRefModelCallback = pytest.importorskip("trl.trainer.callbacks").SyncRefModelCallback


def grpo(**kwargs: Any) -> GRPOModule:
    options = {
        "reward_funcs": [length_reward], "num_generations": 4, "max_completion_length": 4, "learning_rate": 1e-2,
        "scheduler": "constant", "max_grad_norm": 0.0, "generation_seed": 0, "beta": 0.1, "sync_ref_model": True,
        "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.6,
    }  # fmt: skip
    options.update(kwargs)
    return GRPOModule(tiny_llama(0, eos_bias=3.0), tokenizer=transformers.ByT5Tokenizer(), **options)


def data(n: int = 16) -> PromptDataModule:
    prompts = Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(n)]})
    return PromptDataModule(
        tokenizer=transformers.ByT5Tokenizer(), dataset=prompts, batch_size=4, max_length=16, val_size=0,
        sampling="sequential",
    )  # fmt: skip


class _Params:
    """What TRL's ``SyncRefModelCallback._sync_target_model`` reads from a model: ``parameters()``."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.params = params

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())


class Snapshots(L.Callback):
    """Policy and reference parameters after every optimizer step (``on_train_batch_end`` sees the synced ref)."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[dict, dict]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        copy = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}
        self.steps[trainer.global_step] = (copy(pl_module.model), copy(pl_module.ref_model))


def test_reference_is_mixed_every_n_steps_as_the_reference_formula():
    module = grpo()
    ref0 = {n: p.detach().clone() for n, p in module.ref_model.named_parameters()}
    snapshots = Snapshots()
    L.Trainer(max_steps=4, callbacks=[snapshots], **QUIET).fit(module, datamodule=data())
    snap = snapshots.steps

    def mixed(ref: dict, policy: dict) -> dict:  # TRL 1.16's own SyncRefModelCallback on copies of the tensors
        target = {n: torch.nn.Parameter(t.clone()) for n, t in ref.items()}
        source = {n: torch.nn.Parameter(policy[n].clone()) for n in ref}
        SyncRefModelCallback._sync_target_model(_Params(source), _Params(target), 0.6)
        return {n: p.detach() for n, p in target.items()}

    assert all(torch.equal(snap[1][1][n], ref0[n]) for n in ref0)  # step 1: untouched
    after2 = mixed(ref0, snap[2][0])
    assert all(torch.equal(snap[2][1][n], after2[n]) for n in ref0)  # step 2: mixed with the step-2 policy
    assert all(torch.equal(snap[3][1][n], after2[n]) for n in ref0)
    after4 = mixed(after2, snap[4][0])
    assert all(torch.equal(snap[4][1][n], after4[n]) for n in ref0)
    assert not all(torch.equal(after4[n], ref0[n]) for n in ref0)


def test_grpo_and_dpo_share_one_mechanism():
    assert issubclass(GRPOModule, ReferenceSyncMixin) and issubclass(DPOModule, ReferenceSyncMixin)
    assert GRPOModule.sync_reference_model is DPOModule.sync_reference_model is ReferenceSyncMixin.sync_reference_model
    module = grpo()
    with torch.no_grad():  # hand-computed: ref = 1, policy = 3, α = 0.25 -> 0.75 * 1 + 0.25 * 3 = 1.5
        for p in module.ref_model.parameters():
            p.fill_(1.0)
        for p in module.model.parameters():
            p.fill_(3.0)
    module.sync_reference_model(alpha=0.25)
    assert all(bool((p == 1.5).all()) for p in module.ref_model.parameters())
    assert all(bool((p == 3.0).all()) for p in module.model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": 0.0}, r"sync_ref_model=True\)` with beta=0.0.*Set beta > 0"),
        ({"ref_model_mixup_alpha": 1.5}, r"ref_model_mixup_alpha=1.5.*alpha must be in \[0, 1\]"),
        ({"ref_model_sync_steps": 0}, r"ref_model_sync_steps=0.*period >= 1"),
        ({"peft_config": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}}, "adapters disabled"),
    ],
)
def test_invalid_sync_options_are_refused_with_the_fix(kwargs, match):
    if "peft_config" in kwargs:
        pytest.importorskip("peft")
    with pytest.raises(ValueError, match=match):
        grpo(**kwargs)


def test_synced_reference_resumes_exactly(tmp_path):
    def fit(ckpt: str | None, callbacks: list) -> GRPOModule:
        module = grpo()
        trainer = L.Trainer(
            max_steps=4, callbacks=callbacks, default_root_dir=tmp_path,
            **{**QUIET, "enable_checkpointing": bool(callbacks)},
        )  # fmt: skip
        trainer.fit(module, datamodule=data(), ckpt_path=ckpt)
        return module

    straight = fit(None, [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    state = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["state_dict"]
    initial = grpo()
    # the checkpoint of step 2 holds the reference as synced at step 2 (not the initial policy)
    assert any(not torch.equal(state[f"ref_model.{n}"], p) for n, p in initial.model.named_parameters())
    resumed = fit(str(tmp_path / "epoch=0-step=2.ckpt"), [])
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
