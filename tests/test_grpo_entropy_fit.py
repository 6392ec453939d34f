"""GRPOModule fits with ``top_entropy_quantile``, ``entropy_coef`` (static and adaptive) and
``off_policy_mask_threshold``: the step gradient against one written out row by row, the logged metrics, and exact
resume of the adaptive entropy state."""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from test_grpo_module import QUIET, length_reward

from helpers.accumulation import calibrated
from helpers.models import tiny_llama
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.modules.grpo import GRPOModule

TEMPERATURE = 0.8


def grpo(model: Any = None, **kwargs: Any) -> GRPOModule:
    options = {
        "reward_funcs": [length_reward], "num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-2,
        "scheduler": "constant", "max_grad_norm": 0.0, "generation_seed": 0, "temperature": TEMPERATURE,
    }  # fmt: skip
    options.update(kwargs)
    model = model if model is not None else tiny_llama(3, eos_bias=3.0)
    return GRPOModule(model, tokenizer=transformers.ByT5Tokenizer(), **options)


def data(n: int = 12, batch_size: int = 4) -> PromptDataModule:
    prompts = Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(n)]})
    return PromptDataModule(
        tokenizer=transformers.ByT5Tokenizer(), dataset=prompts, batch_size=batch_size, max_length=16, val_size=0,
        sampling="sequential",
    )  # fmt: skip


class FirstStep(L.Callback):
    """The first optimizer step's gradients and the buffered micro-batches that produced them."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.clone() for n, p in pl_module.model.named_parameters()}
            self.slices = [dict(s) for s in pl_module._buffer.slices]


def _row_terms(model: Any, row: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Log-probs and entropies (with grad) of one row's kept completion tokens, without padding."""
    prompt = row["prompt_ids"][row["prompt_mask"].bool()]
    kept = row["completion_ids"][row["completion_mask"].bool()]
    if kept.numel() == 0:
        return None
    logits = model(input_ids=torch.cat([prompt, kept]).unsqueeze(0)).logits[0, prompt.numel() - 1 : -1]
    z = logits / TEMPERATURE
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, kept.unsqueeze(-1)).squeeze(-1), -(lp.exp() * lp).sum(-1)


def independent_gradient(model: Any, slices: list[dict], rho: float, coef: float, drop_bonus: bool = False) -> dict:
    """dapo on-policy step gradient written out: per micro-batch the tokens at or above the ``1 - rho`` quantile of
    its entropies train ``-A exp(lp - sg lp)``, summed over the step / the step's tokens, minus ``coef`` times the
    mean entropy of those tokens per micro-batch, averaged over the micro-batches."""
    model.zero_grad()
    tokens = sum(int(s["completion_mask"].sum()) for s in slices)
    loss = 0.0
    for s in slices:
        terms = [_row_terms(model, {k: s[k][i] for k in s}) for i in range(s["advantages"].shape[0])]
        pool = torch.cat([t[1].detach() for t in terms if t is not None])
        threshold = torch.quantile(pool, 1 - rho)  # in the twin's dtype
        kept_entropy, kept_count = 0.0, 0
        for advantage, t in zip(s["advantages"], terms):
            if t is None:
                continue
            lp, h = t
            keep = (h.detach() >= threshold).to(lp.dtype)
            loss = loss + (-advantage * torch.exp(lp - lp.detach()) * keep).sum() / tokens
            kept_entropy, kept_count = kept_entropy + (h * keep).sum(), kept_count + int(keep.sum())
        if not drop_bonus:
            loss = loss - coef * kept_entropy / max(1, kept_count) / len(slices)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_entropy_quantile_and_bonus_step_gradient_equals_the_written_out_one():
    model = tiny_llama(3, eos_bias=3.0)
    initial = copy.deepcopy(model)
    recorder = FirstStep()
    module = grpo(model, top_entropy_quantile=0.5, entropy_coef=0.5)
    trainer = L.Trainer(max_steps=1, accumulate_grad_batches=2, log_every_n_steps=1, callbacks=[recorder], **QUIET)
    trainer.fit(module, datamodule=data())
    assert len(recorder.slices) == 2
    expected = calibrated(
        lambda m: independent_gradient(m, recorder.slices, 0.5, 0.5),
        initial,
        mistake=lambda m: independent_gradient(m, recorder.slices, 0.5, 0.5, drop_bonus=True),
        what="entropy-masked step gradient with the bonus",
    )
    expected.check(recorder.grads)
    metrics = trainer.callback_metrics
    assert metrics["entropy_coef"] == pytest.approx(0.5)
    assert "policy_loss" in metrics
    # loss = policy - 0.5 * H (H of the kept tokens, > 0): the logged loss is below the policy loss
    assert metrics["train_loss"] < metrics["policy_loss"]


def test_without_the_bonus_no_policy_loss_is_logged_and_the_entropy_has_no_gradient():
    module = grpo()
    trainer = L.Trainer(max_steps=1, log_every_n_steps=1, **QUIET)
    trainer.fit(module, datamodule=data())
    assert "policy_loss" not in trainer.callback_metrics and "entropy_coef" not in trainer.callback_metrics
    rows = {k: v[:2] for k, v in module._buffer.slices[0].items()}
    _, entropy = module.completion_logps(module.model, rows, with_entropy=True)
    assert not entropy.requires_grad
    _, entropy = module.completion_logps(module.model, rows, with_entropy=True, entropy_grad=True)
    assert entropy.requires_grad


def off_policy_gradient(model: Any, rows: dict, threshold: float | None) -> dict:
    """dapo step gradient of an off-policy pass written out row by row: ``-min(r A, clip(r) A)`` with
    ``r = exp(lp - old)``, a row left out of the policy term when ``A < 0`` and ``mean(old - lp) > threshold``."""
    model.zero_grad()
    tokens = int(rows["completion_mask"].sum())
    loss = 0.0
    for i in range(rows["advantages"].shape[0]):
        row = {k: v[i] for k, v in rows.items()}
        terms = _row_terms(model, row)
        if terms is None:
            continue
        lp, old, a = terms[0], row["old_logps"][row["completion_mask"].bool()].to(terms[0].dtype), row["advantages"]
        if threshold is not None and a < 0 and (old - lp.detach()).mean() > threshold:
            continue
        r = torch.exp(lp - old)
        loss = loss - torch.min(r * a, r.clamp(0.8, 1.2) * a).sum() / tokens
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class Recorder(L.Callback):
    """Every step's gradients, its first buffered micro-batch and the weights it was computed with."""

    def __init__(self) -> None:
        self.grads, self.rows, self.models = [], [], []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.model.named_parameters()})
        self.rows.append(dict(pl_module._buffer.slices[0]))
        self.models.append(copy.deepcopy(pl_module.model))


def test_off_policy_mask_step_gradient_equals_the_written_out_one():
    """num_iterations = 2: the second step replays the first step's rows off-policy (old log-probs stored); with a
    negative threshold every negative-advantage row that drifted the "wrong" way is left out of the policy term."""
    threshold = -1e-4
    recorder = Recorder()
    module = grpo(num_iterations=2, off_policy_mask_threshold=threshold, learning_rate=1e-3)  # ratios stay unclipped
    L.Trainer(max_steps=2, callbacks=[recorder], **QUIET).fit(module, datamodule=data(batch_size=8))
    rows, model = recorder.rows[1], recorder.models[1]
    assert "old_logps" in rows and torch.equal(rows["old_logps"], recorder.rows[0]["old_logps"])
    expected = calibrated(
        lambda m: off_policy_gradient(m, rows, threshold),
        model,
        mistake=lambda m: off_policy_gradient(m, rows, None),
        what="off-policy masked step gradient",
    )
    expected.check(recorder.grads[1])


def test_adaptive_entropy_state_resumes_exactly(tmp_path):
    options = {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 100.0, "entropy_coef_delta": 0.1}

    def fit(ckpt: str | None, callbacks: list) -> GRPOModule:
        module = grpo(**options)
        trainer = L.Trainer(
            max_steps=4, accumulate_grad_batches=2, callbacks=callbacks, default_root_dir=tmp_path,
            **{**QUIET, "enable_checkpointing": bool(callbacks)},
        )  # fmt: skip
        trainer.fit(module, datamodule=data(24), ckpt_path=ckpt)
        return module

    straight = fit(None, [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["grpo_entropy_control"]
    # entropy (a few nats) <= target 100 after each step: 0.05 -> 0.15 -> 0.25, measured each step
    assert saved["coef"] == pytest.approx(0.25) and math.isfinite(saved["last_entropy"])
    assert saved["windows"] == [None]  # written at a step boundary: no partial window
    assert straight._entropy.coef == pytest.approx(0.45)
    resumed = fit(str(tmp_path / "epoch=0-step=2.ckpt"), [])
    assert resumed._entropy.coef == straight._entropy.coef
    assert resumed._entropy.last_entropy == straight._entropy.last_entropy
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_adaptive_entropy_state_resumes_exactly_from_inside_an_optimizer_step(tmp_path):
    """A validation between the two micro-batches of step 1 writes a checkpoint holding that step's partial entropy
    sums (and, with ExactResume, its gradients so far); resuming from it ends with the uninterrupted run's weights and
    coefficient. It also needs the dapo normaliser of the resumed step to count the micro-batch run before the
    checkpoint."""
    from lit_trainer.callbacks import ExactResume

    options = {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 100.0, "entropy_coef_delta": 0.1}

    def fit(ckpt: str | None, callbacks: list) -> tuple[GRPOModule, dict[int, float]]:
        module, measured = grpo(**options), MeasuredEntropy()
        callbacks = [*callbacks, measured]
        prompts = Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(24)]})
        dm = PromptDataModule(
            tokenizer=transformers.ByT5Tokenizer(), dataset=prompts, batch_size=4, max_length=16, val_size=4,
            sampling="sequential",
        )  # fmt: skip
        trainer = L.Trainer(
            max_steps=4, accumulate_grad_batches=2, val_check_interval=3, callbacks=[ExactResume(), *callbacks],
            default_root_dir=tmp_path, **{**QUIET, "limit_val_batches": None, "enable_checkpointing": bool(callbacks)},
        )  # fmt: skip
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
        return module, measured.steps

    saves = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_reward", mode="max", save_top_k=-1)
    straight, straight_entropy = fit(None, [saves])
    path = tmp_path / "ck" / "epoch=0-step=1.ckpt"
    saved = torch.load(path, weights_only=True)["grpo_entropy_control"]
    assert saved["windows"][0] is not None and saved["windows"][0][1] > 0  # step 1's first micro-batch: tokens
    resumed, resumed_entropy = fit(str(path), [])
    assert resumed._entropy.coef == straight._entropy.coef == pytest.approx(0.45)
    # the entropy measured at the end of every step after the checkpoint, step 2 included (its first micro-batch ran
    # before the checkpoint: its sums come from the checkpoint)
    assert list(resumed_entropy) == [2, 3, 4]
    assert resumed_entropy == {k: straight_entropy[k] for k in (2, 3, 4)}
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


class MeasuredEntropy(L.Callback):
    """The entropy the adaptive control measured at the end of each optimizer step, by step."""

    def __init__(self) -> None:
        self.steps: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step not in self.steps and trainer.global_step > 0:
            self.steps[trainer.global_step] = pl_module._entropy.last_entropy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile=1.5.*in \[0, 1\]"),
        ({"entropy_coef": float("nan")}, r"entropy_coef=nan.*finite"),
        ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, r"entropy_coef_min=0.5, entropy_coef_max=0.1"),
        ({"entropy_coef_delta": -0.1}, r"entropy_coef_delta=-0.1.*>= 0"),
        ({"off_policy_mask_threshold": float("inf")}, r"off_policy_mask_threshold=inf.*e.g. 0.5"),
    ],
)
def test_entropy_and_mask_options_are_validated_with_a_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo(**kwargs)


def test_bonus_with_a_step_spanning_two_rounds_is_refused_at_setup():
    """dapo with steps_per_generation 3 and accumulate 2 rescales the whole step gradient at its end, bonus included."""
    module = grpo(entropy_coef=0.1, steps_per_generation=3)
    trainer = L.Trainer(max_steps=1, accumulate_grad_batches=2, **QUIET)
    with pytest.raises(ValueError, match="Make steps_per_generation a multiple of accumulate_grad_batches"):
        trainer.fit(module, datamodule=data())
