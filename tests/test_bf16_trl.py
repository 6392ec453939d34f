"""Every module under Lightning's ``precision="bf16-mixed"`` against TRL 1.16 under its own default (``bf16=None``,
which resolves to bf16 mixed precision, also on the CPU): the loss and gradients of one optimizer step on the same
initial weights and the same batch.

Our side is a real ``Trainer(precision="bf16-mixed", accelerator="cpu").fit`` step (autocast around the training
step, float32 weights); TRL's side is its trainer's ``compute_loss`` under its accelerator's autocast (what accelerate
wraps the model's forward in when ``mixed_precision="bf16"``), with every option at TRL's default but the ones that
make the two runs comparable. The tolerance is calibrated where the test runs: ``scale`` is how far TRL's own bf16
result lies from its float32 result (the rounding bf16 introduces into THIS computation), and ours must be within
:data:`FACTOR` times that of TRL's bf16 result; ours must also be as close to float32 as TRL's is. Measured on the
tiny preset (CPU): TRL's bf16-vs-float32 gradient distance is 1e-3 to 1e-2 (relative L2) and ours lies about as far
from TRL's bf16 result; a real mistake (chosen and rejected swapped, the advantages negated, the loss over the prompt
tokens too) is of order 1, far above the bound. The float32 comparisons of each module with TRL are in
``test_reward_trl.py``, ``test_grpo_tools_trl.py`` and ``test_grpo_reward_models.py``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Any

import lightning as L
import pytest
import torch
from datasets import Dataset

from helpers.rounding import relative_l2
from helpers.tool_policy import ForcedGenerate
from lit_trainer import CausalLMModule, DPOModule, GRPOModule, RewardModule
from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.rewards import arithmetic_reward

trl = pytest.importorskip("trl")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytestmark = pytest.mark.slow  # building TRL trainers takes a few seconds each

FACTOR = 4.0  # both bf16 results lie about `scale` from float32 in their own directions: at most ~2 x apart; x2
MISTAKE_MARGIN = 10.0  # a real mistake must be this many bounds away (bf16 rounding is ~1e-2: 100 would not fit)
PROMPTS = ["12+34=", "5+5=", "99+1=", "7+80="]
CHOSEN = ["46", "10", "100", "87"]
REJECTED = ["47", "11", "10", "78"]
G = 3  # GRPO generations per prompt


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


class FirstStep(L.Callback):
    """The first optimizer step's loss and (unclipped) gradients of the policy."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loss = outputs["loss"].detach().float()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads = _grads(pl_module.model)


def ours(module: Any, datamodule: Any, precision: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    step = FirstStep()
    L.Trainer(
        max_steps=1, accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[step],
    ).fit(module, datamodule=datamodule)  # fmt: skip
    return step.loss, step.grads


def theirs(trainer: Any, model: Any, batch: dict, bf16: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's loss and gradients of ``batch``; under its accelerator's autocast when ``bf16``."""
    model.train()
    model.zero_grad()
    context = trainer.accelerator.autocast() if bf16 else contextlib.nullcontext()
    with context:
        loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    return loss.detach().float(), _grads(model)


def check(name: str, got: tuple, trl_bf16: tuple, trl_fp32: tuple, ours_fp32: tuple, mistake: dict) -> None:
    """Ours (bf16) within FACTOR x TRL's own bf16 rounding of TRL's bf16 result, for the loss and the gradients."""
    for what, index in (("loss", 0), ("gradient", 1)):
        pick = (lambda r: {"loss": r[0].reshape(1)}) if index == 0 else (lambda r: r[1])
        scale = relative_l2(pick(trl_bf16), pick(trl_fp32))
        bound = FACTOR * max(scale, 2.0**-8)  # never below bf16's unit roundoff: a lucky exact loss is no scale
        observed = relative_l2(pick(got), pick(trl_bf16))
        ours_rounding = relative_l2(pick(got), pick(ours_fp32))
        print(f"{name} {what}: ours-TRL (bf16) {observed:.2e}, TRL bf16-fp32 {scale:.2e}, ours bf16-fp32 "
              f"{ours_rounding:.2e}, bound {bound:.2e}")  # fmt: skip
        assert observed <= bound, f"{name} {what}: bf16 differs from TRL's bf16 by {observed:.2e} > {bound:.2e}"
        assert ours_rounding <= bound, f"{name} {what}: our bf16 is {ours_rounding:.2e} from float32 > {bound:.2e}"
    mistake_size = relative_l2(mistake, trl_bf16[1])
    assert FACTOR * max(relative_l2(trl_bf16[1], trl_fp32[1]), 2.0**-8) * MISTAKE_MARGIN <= mistake_size


def tiny(task: str = "causal_lm") -> tuple[Any, Any]:
    torch.manual_seed(0)
    return load_model("tiny", task=task), load_tokenizer("tiny")


def data(cls: type, tokenizer: Any, rows: dict, **options: Any) -> Any:
    return cls(
        tokenizer=tokenizer, dataset=Dataset.from_dict(rows), val_size=0, batch_size=options.pop("batch_size", 4),
        max_length=64, sampling="sequential", **options,
    )  # fmt: skip


def collated(datamodule: Any) -> dict[str, torch.Tensor]:
    datamodule.setup("fit")
    rows = [datamodule.train_dataset[i] for i in range(len(datamodule.train_dataset))]
    return datamodule._collate(rows, True)


def trl_trainer(
    trainer_cls: type, config_cls: type, model: Any, tokenizer: Any, rows: dict, tmp_path, bf16: bool, **kw: Any
) -> Any:
    """A TRL trainer at its default precision (bf16) or with ``bf16=False`` (the float32 calibration). Accelerate's
    state is a process-wide singleton: build and use one trainer at a time."""
    extra = {k: copy.deepcopy(v) for k, v in kw.pop("trainer_kwargs", {}).items()}
    args = config_cls(
        output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, **({} if bf16 else {"bf16": False}), **kw
    )
    trainer = trainer_cls(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        **extra,
    )
    assert trainer.accelerator.mixed_precision == ("bf16" if bf16 else "no")
    return trainer


def trl_results(
    trainer_cls: type,
    config_cls: type,
    model: Any,
    tokenizer: Any,
    rows: dict,
    tmp_path,
    mistake: Any = None,
    **kw: Any,
) -> tuple:
    """TRL's (bf16 result, float32 result, its collated batch, the gradient of ``mistake(batch)`` in float32)."""
    results, wrong = [], None
    for bf16 in (True, False):
        trainer = trl_trainer(trainer_cls, config_cls, model, tokenizer, rows, tmp_path, bf16, **kw)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
        results.append(theirs(trainer, trainer.model, batch, bf16))
        if not bf16 and mistake is not None:
            wrong = theirs(trainer, copy.deepcopy(trainer.model), mistake(batch), False)[1]
    return results[0], results[1], batch, wrong


def test_sft_bf16_mixed_matches_trl(tmp_path):
    model, tokenizer = tiny()
    rows = {"prompt": PROMPTS, "completion": CHOSEN}
    all_tokens = lambda b: {**b, "labels": torch.where(b["attention_mask"].bool(), b["input_ids"], -100)}
    trl_bf16, trl_fp32, batch, mistake = trl_results(
        trl.SFTTrainer, trl.SFTConfig, model, tokenizer, rows, tmp_path, all_tokens  # mistake: prompt tokens trained
    )  # fmt: skip
    assert torch.equal(collated(data(SFTDataModule, tokenizer, rows))["labels"], batch["labels"])
    run = lambda precision: ours(
        CausalLMModule(copy.deepcopy(model), tokenizer=tokenizer), data(SFTDataModule, tokenizer, rows), precision
    )  # fmt: skip
    check("sft", run("bf16-mixed"), trl_bf16, trl_fp32, run("32-true"), mistake)


def test_dpo_bf16_mixed_matches_trl(tmp_path):
    model, tokenizer = tiny()
    rows = {"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED}
    kw = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0], "trainer_kwargs": {"ref_model": model}}
    trl_bf16, trl_fp32, batch, _ = trl_results(trl.DPOTrainer, trl.DPOConfig, model, tokenizer, rows, tmp_path, **kw)
    assert torch.equal(collated(data(PreferenceDataModule, tokenizer, rows))["input_ids"], batch["input_ids"])
    run = lambda precision: ours(
        DPOModule(copy.deepcopy(model), tokenizer=tokenizer, loss_type=["sigmoid", "sft"]),
        data(PreferenceDataModule, tokenizer, rows), precision,
    )  # fmt: skip
    swapped = {"prompt": PROMPTS, "chosen": REJECTED, "rejected": CHOSEN}
    mistake = ours(
        DPOModule(copy.deepcopy(model), tokenizer=tokenizer, loss_type=["sigmoid"]),
        data(PreferenceDataModule, tokenizer, swapped), "32-true",
    )[1]  # fmt: skip
    check("dpo", run("bf16-mixed"), trl_bf16, trl_fp32, run("32-true"), mistake)


def test_reward_bf16_mixed_matches_trl(tmp_path):
    model, tokenizer = tiny("sequence_classification")
    rows = {"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED}
    trl_bf16, trl_fp32, batch, _ = trl_results(trl.RewardTrainer, trl.RewardConfig, model, tokenizer, rows, tmp_path)
    reward_data = lambda r: data(PreferenceDataModule, tokenizer, r, truncation_mode="drop")
    assert torch.equal(collated(reward_data(rows))["input_ids"], batch["input_ids"])
    run = lambda precision, r=rows: ours(
        RewardModule(copy.deepcopy(model), tokenizer=tokenizer), reward_data(r), precision
    )
    mistake = run("32-true", {"prompt": PROMPTS, "chosen": REJECTED, "rejected": CHOSEN})[1]  # preferences swapped
    check("reward", run("bf16-mixed"), trl_bf16, trl_fp32, run("32-true"), mistake)


def _answer(context: str, occurrence: int) -> str:
    """The scripted completions: the sum, a near miss, and a longer wrong answer."""
    a, b = (int(x) for x in context.rstrip("=").split("+"))
    return [f"{a + b}</s>", f"{a + b + 1}</s>", f"{a + b}0{a}</s>"][occurrence % G]


def test_grpo_bf16_mixed_matches_trl(tmp_path):
    model, tokenizer = tiny()
    rows = {"prompt": PROMPTS, "answer": CHOSEN}
    kw = {"per_device_train_batch_size": len(PROMPTS) * G, "num_generations": G, "max_completion_length": 8}
    inputs = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, CHOSEN) for _ in range(G)]
    results = []
    for bf16 in (True, False):
        trainer = trl_trainer(
            trl.GRPOTrainer, trl.GRPOConfig, model, tokenizer, rows, tmp_path, bf16,
            trainer_kwargs={"reward_funcs": [arithmetic_reward]}, **kw,
        )  # fmt: skip
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which is not run here
        ForcedGenerate(trainer.model, tokenizer, _answer)
        with trainer.accelerator.autocast() if bf16 else contextlib.nullcontext():
            out = trainer._generate_and_score_completions(inputs)
        results.append(theirs(trainer, trainer.model, out, bf16))
    negated = {**out, "advantages": -out["advantages"]}
    mistake = theirs(trainer, copy.deepcopy(trainer.model), negated, False)[1]  # the advantages' sign flipped

    def run(precision: str) -> tuple:
        module = GRPOModule(
            copy.deepcopy(model), tokenizer=tokenizer, reward_funcs=[arithmetic_reward], num_generations=G,
            max_completion_length=8, max_grad_norm=0.0, generation_seed=0,
        )  # fmt: skip
        ForcedGenerate(module.model, tokenizer, _answer)
        return ours(module, data(PromptDataModule, tokenizer, rows, batch_size=len(PROMPTS) * G), precision)

    check("grpo", run("bf16-mixed"), *results, run("32-true"), mistake)
