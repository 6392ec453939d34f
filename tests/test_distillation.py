"""DistillationModule and generalized_jsd_loss against TRL 1.16 (GKDTrainer, DistillationTrainer), on tiny models.

Tolerances (float32 on both sides, measured over 5 seeds of these shapes with a script; bounds 1e-5, >= 25x):
* loss vs TRL's generalized_jsd_loss: <= 1.2e-7 relative; its gradient <= 4e-7 relative L2 (summation order and
  ``log1p(-beta)`` in float64 here vs float32 in TRL);
* chunked divergence vs full logits (and TRL's chunked DistillationTrainer loss): <= 2.2e-7 relative;
* module vs GKDTrainer.compute_loss on the same rows: gradients <= 1.2e-7 relative L2 (0 for beta 0.5);
* accumulation (2 micro-batches vs one full batch of the same rows): <= 3e-7 relative L2 (with the step-end rescale).
"""

from __future__ import annotations

import copy
import types

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset

from helpers.models import tiny_llama
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.losses.distillation import chunked_token_divergence, generalized_jsd_loss
from lit_trainer.models import load_tokenizer
from lit_trainer.modules.base import _logits
from lit_trainer.modules.distillation import DistillationModule

TOL = 1e-5
PROMPTS = ["12+34=", "56+17=", "90+99=", "23+45=", "31+62=", "77+18=", "40+40=", "11+89="]
ANSWERS = ["46", "73", "189", "68", "93", "95", "80", "100"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


def _dm(tokenizer, batch_size: int = 4) -> SFTDataModule:
    rows = Dataset.from_dict({"prompt": PROMPTS, "completion": ANSWERS})
    dm = SFTDataModule(
        tokenizer=tokenizer, dataset=rows, val_size=0, batch_size=batch_size, max_length=16, sampling="sequential"
    )
    dm.setup("fit")
    return dm


def _batch(dm: SFTDataModule, rows: list[int]) -> dict[str, torch.Tensor]:
    return dm._collate([dm.train_dataset[i] for i in rows], True)


def _module(tokenizer, **options) -> DistillationModule:
    student = tiny_llama(seed=0, hidden=16, eos_bias=6.0)  # EOS about half the time: completions of varied length
    teacher = tiny_llama(seed=1, hidden=32, eos_bias=3.0)  # another width, the same vocabulary
    options = {"max_new_tokens": 4, "temperature": 1.0, "learning_rate": 1e-3, "generation_seed": 0, **options}
    return DistillationModule(student, teacher_model=teacher, tokenizer=tokenizer, **options)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(((a[k] - b[k]).double() ** 2).sum() for k in a) ** 0.5
    return float(num / sum((b[k].double() ** 2).sum() for k in b) ** 0.5)


# ------------------------------------------------------------------------------------------------- the loss
def _random_logits(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(3, 5, 11, generator=g) * 3).requires_grad_(True)
    teacher = torch.randn(3, 5, 11, generator=g) * 3
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, :2], labels[2, 3:] = -100, -100  # a prompt and padding
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none", "num_items"])
def test_loss_and_gradient_equal_trl_gkd(beta, reduction):
    from trl.experimental.gkd import GKDTrainer

    student, teacher, labels = _random_logits()
    for with_labels in (True, False):
        kwargs = {"beta": beta, "temperature": 0.7, "labels": labels if with_labels else None}
        if reduction == "num_items":
            kwargs["num_items_in_batch"] = torch.tensor(17)
        else:
            kwargs["reduction"] = reduction
        ours = generalized_jsd_loss(student, teacher, **kwargs)
        (g_ours,) = torch.autograd.grad(ours.sum(), student)
        theirs = GKDTrainer.generalized_jsd_loss(student, teacher, **kwargs)
        (g_theirs,) = torch.autograd.grad(theirs.sum(), student)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)
        torch.testing.assert_close(g_ours, g_theirs, rtol=TOL, atol=TOL * g_theirs.abs().max().item())
        assert g_ours.abs().max() > 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_divergence_equals_full_and_trl_distillation_trainer(beta):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    g = torch.Generator().manual_seed(3)
    h_s = torch.randn(2, 6, 8, generator=g).requires_grad_(True)
    h_t = torch.randn(2, 6, 12, generator=g)
    w_s, w_t = torch.randn(19, 8, generator=g).requires_grad_(True), torch.randn(19, 12, generator=g)
    bias = torch.randn(19, generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:], mask[1, :1] = 0, 0
    valid = mask.bool()
    per_token = chunked_token_divergence(
        h_s[valid], w_s, h_t[valid], w_t, teacher_bias=bias, beta=beta, temperature=0.8, chunk_size=3
    )
    ours = per_token.sum() / 7
    theirs, _, count = _chunked_divergence_loss(
        h_s, h_t, w_s, w_t, mask, beta, num_items_in_batch=7, teacher_lm_head_bias=bias, temperature=0.8
    )
    full = generalized_jsd_loss(h_s @ w_s.T, h_t @ w_t.T + bias, torch.where(valid, 0, -100), beta=beta,
                                temperature=0.8, reduction="sum") / 7  # fmt: skip
    assert int(count) == 9
    for value in (theirs, full):
        torch.testing.assert_close(ours, value, rtol=TOL, atol=TOL)
        expected = torch.autograd.grad(value, (h_s, w_s))
        got = torch.autograd.grad(ours, (h_s, w_s), retain_graph=True)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL * b.abs().max().item())


def test_loss_refuses_bad_options():
    s, t, labels = _random_logits()
    with pytest.raises(ValueError, match="beta=1.5"):
        generalized_jsd_loss(s, t, labels, beta=1.5)
    with pytest.raises(ValueError, match="temperature=0"):
        generalized_jsd_loss(s, t, labels, temperature=0)
    with pytest.raises(ValueError, match="reduction='avg'"):
        generalized_jsd_loss(s, t, labels, reduction="avg")
    with pytest.raises(ValueError, match="vocabularies must be the same"):
        chunked_token_divergence(s[0], torch.zeros(11, 11), t[0], torch.zeros(12, 11))


# ---------------------------------------------------------------------------------------------- the module
def _trl_gkd(module: DistillationModule):
    """The attributes GKDTrainer.compute_loss reads, on our models."""
    from trl.experimental.gkd import GKDTrainer

    return types.SimpleNamespace(
        teacher_model=module.teacher_model,
        beta=module.hparams.beta,
        generalized_jsd_loss=GKDTrainer.generalized_jsd_loss,
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_module_loss_equals_trl_gkd_compute_loss(tokenizer, beta):
    """Dataset completions (off-policy) and scripted student completions (on-policy, through TRL's own
    ``generate_on_policy_outputs``): our loss and gradient equal GKDTrainer.compute_loss's on the same rows.
    (GKDTrainer.compute_loss scores at temperature 1, so the module runs at temperature 1 here.)"""
    from transformers import GenerationConfig
    from trl.experimental.gkd import GKDTrainer

    module = _module(tokenizer, beta=beta)
    dm = _dm(tokenizer)
    batch = _batch(dm, [0, 1, 2, 3])
    # the dataset's completions
    ours, _ = module.compute_loss(batch, None)
    ours.backward()
    g_ours = _grads(module.model)
    module.model.zero_grad()
    theirs = GKDTrainer.compute_loss(_trl_gkd(module), module.model, dict(batch))
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)
    assert _rel(g_ours, _grads(module.model)) < TOL
    module.model.zero_grad()

    # scripted on-policy completions: a generate that returns fixed tokens (EOS = 1 ends rows 0 and 2 early)
    starts = (batch["labels"] != -100).int().argmax(1).tolist()
    prompts = [row[:n] for row, n in zip(batch["input_ids"].tolist(), starts)]
    prompt_ids = torch.tensor(prompts)  # the prompts have the same length: no padding
    scripted = torch.tensor([[57, 1, 9, 9], [55, 56, 57, 58], [1, 4, 4, 4], [60, 61, 1, 0]])
    sampler = types.SimpleNamespace(
        generate=lambda **kw: types.SimpleNamespace(sequences=torch.cat([kw["input_ids"], scripted], dim=1))
    )
    config = GenerationConfig(max_new_tokens=4, eos_token_id=1, pad_token_id=0)
    trl_ids, trl_mask, trl_labels = GKDTrainer.generate_on_policy_outputs(
        sampler, {"prompts": prompt_ids, "prompt_attention_mask": torch.ones_like(prompt_ids)}, config
    )
    from lit_trainer.generation.engines import cut_after_eos

    cut = cut_after_eos(scripted, [1], 0)
    rows = module.rows_with_completions(prompts, cut.ids, cut.mask, 0)
    ours, _ = module.compute_loss(rows, None)
    ours.backward()
    g_ours = _grads(module.model)
    module.model.zero_grad()
    inputs = {"input_ids": trl_ids, "attention_mask": trl_mask, "labels": trl_labels}
    theirs = GKDTrainer.compute_loss(_trl_gkd(module), module.model, inputs)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)
    assert _rel(g_ours, _grads(module.model)) < TOL
    assert int((rows["labels"] != -100).sum()) == 2 + 4 + 1 + 3  # completions cut after EOS (kept)


def test_chunked_module_equals_full(tokenizer):
    batch = _batch(_dm(tokenizer), [0, 1, 2, 3])
    results = []
    for setting in ("off", "on"):
        module = _module(tokenizer, beta=0.5, temperature=0.8, chunked_logits=setting, logits_chunk_size=5)
        loss, _ = module.compute_loss(batch, torch.tensor(30.0))
        loss.backward()
        results.append((loss.detach(), _grads(module.model)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=TOL, atol=TOL)
    assert _rel(results[1][1], results[0][1]) < TOL


def test_vocabulary_mismatch_is_refused(tokenizer):
    with pytest.raises(ValueError, match="vocab_size 384 .* and the teacher 400"):
        DistillationModule(tiny_llama(hidden=16), teacher_model=tiny_llama(hidden=16, vocab=400), tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"lmbda=1.5"):
        _module(tokenizer, lmbda=1.5)


def test_on_policy_draws_are_seeded_and_follow_lmbda(tokenizer):
    module = _module(tokenizer, lmbda=0.3, generation_seed=7)
    draws = [module.on_policy_draw(0, i) for i in range(400)]
    again = _module(tokenizer, lmbda=0.3, generation_seed=7)
    assert draws == [again.on_policy_draw(0, i) for i in range(400)]
    assert 0.22 < sum(draws) / 400 < 0.38  # binomial(400, 0.3): 4 standard deviations
    module.hparams.lmbda = 0.0
    assert not any(module.on_policy_draw(0, i) for i in range(50))
    module.hparams.lmbda = 1.0
    assert all(module.on_policy_draw(0, i) for i in range(50))


class _Record(pl.Callback):
    """The gradient before each optimizer step and the rows each micro-batch trained on."""

    def __init__(self, module: DistillationModule) -> None:
        self.grads, self.rows = [], []
        original = module.compute_loss

        def compute_loss(batch, num_items):
            self.rows.append({k: v.clone() for k, v in batch.items()})
            return original(batch, num_items)

        module.compute_loss = compute_loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append(_grads(pl_module.model))


def _fit(module, dm, accumulate: int, steps: int) -> _Record:
    record = _Record(module)
    trainer = pl.Trainer(
        max_steps=steps, accumulate_grad_batches=accumulate, callbacks=[record], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    return record


@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_accumulation_equals_full_batch_and_lmbda_picks_the_completions(tokenizer, lmbda):
    """accumulate_grad_batches=2 of 2 rows: the step's gradient is the full-batch token-mean gradient of the 4 rows
    it trained on (sampled completions of varying length with lmbda=1: the step-end rescale); lmbda=0 trains on the
    dataset's completions, lmbda=1 on the student's samples."""
    module = _module(tokenizer, lmbda=lmbda, beta=0.5, max_grad_norm=None)
    start = copy.deepcopy(module.model)
    dm = _dm(tokenizer, batch_size=2)
    record = _fit(module, dm, accumulate=2, steps=1)
    assert len(record.rows) == 2 and len(record.grads) == 1
    dataset = _batch(dm, [0, 1, 2, 3])
    if lmbda == 0.0:
        for k, rows in enumerate(record.rows):
            assert torch.equal(rows["labels"], _batch(dm, [2 * k, 2 * k + 1])["labels"])
    else:
        assert not torch.equal(record.rows[0]["labels"], dataset["labels"][:2])
        lengths = [int((r["labels"] != -100).sum()) for r in record.rows]
        assert sum(lengths) != int((dataset["labels"] != -100).sum())  # the step-end rescale matters
    # the full batch: the same rows in one pass, token mean
    reference = _module(tokenizer, lmbda=lmbda, beta=0.5)
    reference.model.load_state_dict(start.state_dict())
    total, count = 0.0, 0
    for rows in record.rows:
        part, n = reference.divergence_sum(rows, _logits.next_token_targets(rows["labels"]))
        total, count = total + part, count + n
    (total / count).backward()
    assert _rel(record.grads[0], _grads(reference.model)) < TOL


def test_fit_learns_teacher_frozen_and_out_of_checkpoints(tokenizer, tmp_path):
    module = _module(tokenizer, lmbda=0.5, learning_rate=1e-2)
    teacher = copy.deepcopy(module.teacher_model.state_dict())
    dm = _dm(tokenizer, batch_size=8)
    batch = _batch(dm, list(range(8)))
    before, _ = module.compute_loss(batch, None)
    trainer = pl.Trainer(
        max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    after, _ = module.compute_loss(batch, None)
    assert after < before  # the divergence to the teacher fell
    assert all(torch.equal(v, teacher[k]) for k, v in module.teacher_model.state_dict().items())
    assert not any(p.requires_grad or p.grad is not None for p in module.teacher_model.parameters())
    assert not module.teacher_model.training and module.model.training
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in module.teacher_model.parameters()}
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert not [k for k in saved["state_dict"] if k.startswith("teacher_model.")]
    assert any(k.startswith("model.") for k in saved["state_dict"])
    fresh = _module(tokenizer, lmbda=0.5)
    fresh.on_load_checkpoint(saved)
    fresh.load_state_dict(saved["state_dict"])  # strict: the live teacher's weights were put back
    assert torch.equal(fresh.model.lm_head.weight, module.model.lm_head.weight)


def test_lora_student_trains_only_its_adapters(tokenizer, tmp_path):
    """A peft (LoRA) student: only the adapters change (the student's base and the teacher stay as they were), on- and
    off-policy micro-batches (sampling through the peft model), and the checkpoint holds the adapters only: no
    teacher key, no base key; it loads back into a fresh module."""
    options = {"lmbda": 0.5, "learning_rate": 1e-2, "generation_seed": 1}  # draws: sampled, then dataset
    peft = {"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    module = _module(tokenizer, **options, **peft)
    sources, rows = [], module._training_rows
    module._training_rows = lambda batch, i: (result := rows(batch, i), sources.append(result[1]))[0]
    frozen = {n: p.detach().clone() for n, p in module.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    teacher = copy.deepcopy(module.teacher_model.state_dict())
    assert adapters and all("lora_" in n for n in adapters)
    trainer = pl.Trainer(
        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=_dm(tokenizer, batch_size=4))
    assert sources == ["student", "dataset"]
    live = dict(module.model.named_parameters())
    assert all(torch.equal(live[n], v) for n, v in frozen.items())
    assert all(not torch.equal(live[n], v) for n, v in adapters.items() if ".lora_B." in n)  # B starts at zero
    assert all(torch.equal(v, teacher[k]) for k, v in module.teacher_model.state_dict().items())
    path = tmp_path / "lora.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert set(saved) == {f"model.{n}" for n in adapters}  # adapters only: no base, no teacher
    fresh = _module(tokenizer, **options, **peft)
    fresh.on_load_checkpoint(torch.load(path, weights_only=True))
    fresh.load_state_dict(saved, strict=False)
    assert all(torch.equal(dict(fresh.model.named_parameters())[n], live[n]) for n in adapters)


def test_resume_is_bit_exact_with_the_saved_seed(tmp_path, tokenizer):
    """Stop after step 2 of 5 (an epoch is 4 steps), resume from the checkpoint in a process whose torch seed differs:
    the same on-policy draws and samples (the generation seed comes from the checkpoint), the same final weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(ckpt_path, callbacks, torch_seed):
        module = _module(tokenizer, lmbda=0.5, generation_seed=None)
        record = _Record(module)
        torch.manual_seed(torch_seed)  # the default generation seed is torch's initial seed at fit start
        pl.Trainer(
            max_steps=5, callbacks=[record, *callbacks], logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, accelerator="cpu",
            enable_checkpointing=bool(callbacks), default_root_dir=tmp_path,
        ).fit(module, datamodule=_dm(tokenizer, batch_size=2), ckpt_path=ckpt_path)  # fmt: skip
        return module, record

    full, full_record = fit(None, [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)], 1)
    resumed, resumed_record = fit(str(tmp_path / "epoch=0-step=2.ckpt"), [], 2)
    sources = [int((r["labels"] != -100).sum()) for r in full_record.rows]
    assert [int((r["labels"] != -100).sum()) for r in resumed_record.rows] == sources[2:]
    assert len({len(r["labels"][0]) for r in full_record.rows}) > 1  # both kinds of completions were trained on
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_inside_an_accumulation_window_resumes_bit_exactly(tmp_path, tokenizer):
    """accumulate 2, a validation (and ModelCheckpoint save) after micro-batch 2, inside step 1's window (micro-batches
    2 and 3); with this seed micro-batch 2 is sampled by the student and 3 is not. Resumed with ExactResume (which
    restores micro-batch 2's gradient; the loader re-reads it without training it) in a process with another torch
    seed: the window's step-end token correction still counts micro-batch 2's sampled tokens (kept in the
    checkpoint), and the final weights equal the uninterrupted run's bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_trainer.callbacks import ExactResume

    def fit(ckpt_path, callbacks, torch_seed):
        module = _module(
            tokenizer, lmbda=0.5, generation_seed=4
        )  # draws of epoch 0: dataset, dataset, sampled, dataset
        record = _Record(module)
        rows = Dataset.from_dict({"prompt": PROMPTS, "completion": ANSWERS})
        dm = SFTDataModule(
            tokenizer=tokenizer, dataset=rows, validation_dataset=rows.select(range(2)), batch_size=2, max_length=16,
            sampling="random",
        )  # fmt: skip
        torch.manual_seed(torch_seed)
        pl.Trainer(
            max_steps=2, accumulate_grad_batches=2, val_check_interval=3, callbacks=[ExactResume(), record, *callbacks],
            logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            accelerator="cpu", enable_checkpointing=bool(callbacks), default_root_dir=tmp_path,
        ).fit(module, datamodule=dm, ckpt_path=ckpt_path)  # fmt: skip
        return module, record

    saves = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_loss", save_top_k=-1)  # at each validation's end
    full, full_record = fit(None, [saves], 1)
    path = tmp_path / "ck" / "epoch=0-step=1.ckpt"
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 1 and "window_grads" in state["callbacks"]["ExactResume"]  # inside the window
    assert state["lit_trainer_distillation"]["window"][3] is True  # micro-batch 2 of the window was sampled
    resumed, resumed_record = fit(str(path), [], 2)
    lengths = [tuple(r["labels"].shape) for r in full_record.rows]
    assert [tuple(r["labels"].shape) for r in resumed_record.rows] == lengths[3:]
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def launched(ddp_world):
    """tests/scripts/ddp_distill.py on 2 ranks: a DDP fit, then a sharded (FSDP2) fit."""
    return ddp_world.part("distill")


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_ranks_equal_one_full_batch(launched, tokenizer):
    """2 ranks, each sampling its own completions (lmbda=1) over 2 micro-batches: both ranks step with the gradient of
    the token-mean divergence over the 8 rows of both ranks, computed here in one process."""
    ranks = [torch.load(launched / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(len(r["rows"]) == 2 and len(r["grads"]) == 1 for r in ranks)
    assert _rel(ranks[1]["grads"][0], ranks[0]["grads"][0]) == 0.0  # DDP: the same reduced gradient
    reference = _module(tokenizer, lmbda=1.0, beta=0.5)  # the script's student and teacher (same seeds)
    total, count = 0.0, 0
    for rows in (rows for r in ranks for rows in r["rows"]):
        part, n = reference.divergence_sum(rows, _logits.next_token_targets(rows["labels"]))
        total, count = total + part, count + n
    (total / count).backward()
    dataset_tokens = sum(int((_batch(_dm(tokenizer), [i])["labels"] != -100).sum()) for i in range(8))
    assert int(count) != dataset_tokens  # the sampled lengths differ from the dataset's: the rescale matters
    assert _rel(ranks[0]["grads"][0], _grads(reference.model)) < TOL


def _merged(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The rows of both ranks' micro-batch as one batch (right-padded to the longest: pad 0, mask 0, label -100)."""
    width = max(p["input_ids"].shape[1] for p in parts)
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {
        k: torch.cat([torch.nn.functional.pad(p[k], (0, width - p[k].shape[1]), value=v) for p in parts])
        for k, v in fill.items()
    }


def _replayed_fit(tokenizer, micro_batches: list, sources: list[str], precision: str) -> dict[str, torch.Tensor]:
    """One process, the sharded run's settings with per-device batch 4 = 2 per rank x 2 ranks, training on the rows
    both ranks trained on (their samples included): the single-process counterpart of the sharded fit."""
    from ddp_distill import SHARDED_OPTIONS, SHARDED_SEED, SHARDED_STEPS  # tests/scripts

    module = DistillationModule(
        tiny_llama(seed=0, hidden=16, eos_bias=6.0), teacher_model=tiny_llama(seed=1, hidden=32, eos_bias=3.0),
        tokenizer=tokenizer, max_new_tokens=4, temperature=1.0, generation_seed=SHARDED_SEED, max_grad_norm=None,
        **SHARDED_OPTIONS,
    )  # fmt: skip
    replay = iter(zip(micro_batches, sources))
    module._training_rows = lambda batch, batch_idx: next(replay)
    pl.Trainer(
        max_steps=SHARDED_STEPS, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        accelerator="cpu", precision=precision,
    ).fit(module, datamodule=_dm(tokenizer, batch_size=4))  # fmt: skip
    return {n: p.detach().float().clone() for n, p in module.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.ddp
def test_sharded_two_ranks_end_with_the_single_process_weights(launched, tokenizer):
    """ModelParallelStrategy (FSDP2): student and teacher sharded, chunked divergence on sharded heads, a step on the
    dataset's completions then a step on the sharded student's own samples (each rank its own, of other lengths: the
    step-end rescale over ranks). The final full student weights equal one process trained on the same rows (full
    logits), within the float32 rounding calibrated by that run in float64 (tests/helpers/rounding.py)."""
    from helpers.rounding import Rounding, relative_l2

    ranks = [torch.load(launched / f"sharded_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["types"] == {"DTensor"} for r in ranks)  # student and teacher really sharded
    assert ranks[0]["sources"] == ranks[1]["sources"] == ["dataset", "dataset", "student", "student"]
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])
    validated = ranks[0]["validated"]  # greedy generation of the sharded student ran (ranks kept in step)
    assert validated == ranks[1]["validated"] and set(validated) == {"val_loss", "val_exact_match"}
    assert validated["val_loss"] > 0 and 0 <= validated["val_exact_match"] <= 1
    sampled = [int((rows["labels"] != -100).sum()) for r in ranks for rows in r["rows"][2:]]
    dataset = [int((rows["labels"] != -100).sum()) for r in ranks for rows in r["rows"][:2]]
    assert sum(sampled) != sum(dataset)  # the sampled step's token count is not the loader's: the rescale matters
    micro_batches = [_merged([r["rows"][i] for r in ranks]) for i in range(4)]
    single = _replayed_fit(tokenizer, micro_batches, ranks[0]["sources"], "32-true")
    rounding = Rounding.of(single, _replayed_fit(tokenizer, micro_batches, ranks[0]["sources"], "64-true"))
    initial = {n: p.detach() for n, p in tiny_llama(seed=0, hidden=16, eos_bias=6.0).named_parameters()}
    rounding.check(ranks[0]["weights"], single, mistake=relative_l2(single, initial) / 2)
    # the distributed checkpoint holds the student (and the generation seed), not the teacher; a sharded resume
    # starts from the saved student weights exactly
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(launched / "sharded.ckpt")).read_metadata().state_dict_metadata
    assert any(k.startswith("state_dict.model.") for k in keys)
    assert not any("teacher_model" in k for k in keys)
    restored = ranks[0]["restored"]
    assert int(restored.pop("_seed")) == 4
    assert all(torch.equal(restored[k], v) for k, v in ranks[0]["weights"].items())
