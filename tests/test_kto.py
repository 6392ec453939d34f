"""KTO: ``kto_loss`` by hand, ``KTOModule`` against TRL 1.16's ``KTOTrainer`` (loss, gradients, metrics, the KL rows
it feeds), token-exact accumulation, the unpaired data module, and a short fit that resumes exactly."""

from __future__ import annotations

import copy
import inspect

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.accumulation import GradCapture, calibrated
from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer.callbacks import ExactResume
from lit_trainer.data.unpaired import (
    REF_KEY,
    REF_KL_KEY,
    UnpairedCollator,
    UnpairedPreferenceDataModule,
    addition_unpaired_rows,
    kl_partner_completions,
    unpair_rows,
)
from lit_trainer.losses.kto import kto_kl, kto_kl_terms, kto_loss
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.modules.kto import KTO_METRIC_NAMES, KTOModule

trl = pytest.importorskip("trl")

ROWS = {
    "prompt": ["12+34=", "5+5=", "99+1=", "7+80=", "3+4=", "10+10="],
    "completion": ["46", "11", "100", "78", "7", "2"],
    "label": [True, False, True, False, True, False],
}
# uneven lengths and labels for the accumulation test: micro-batches of 3, 3 and 2 rows
UNEVEN = {
    "prompt": ["1+2=", "100+200=", "5=", "a much longer prompt=", "7+8=", "x=", "12+12=", "what is 3+4="],
    "completion": ["3", "301", "5", "ok", "15", "a longer completion here", "42", "7"],
    "label": [True, False, True, True, False, True, False, True],
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


def _datamodule(tokenizer, rows: dict, **kw) -> UnpairedPreferenceDataModule:
    kw = {"val_size": 0, "max_length": 48, "batch_size": len(rows["prompt"]), "sampling": "sequential", **kw}
    return UnpairedPreferenceDataModule(tokenizer=tokenizer, dataset=Dataset.from_dict(rows), **kw)


def _all_rows(dm: UnpairedPreferenceDataModule) -> dict[str, torch.Tensor]:
    dm.setup("fit")
    return dm._collate([dm.train_dataset[i] for i in range(len(dm.train_dataset))], True)


def _trainer(steps: int, callbacks=(), **kw) -> pl.Trainer:
    kw = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        **kw,
    }
    return pl.Trainer(max_steps=steps, callbacks=list(callbacks), **kw)


# ------------------------------------------------------------------------------------------------ the pure loss
def test_kto_loss_hand_checked_values():
    logps, ref = torch.tensor([-1.0, -3.0, -2.0]), torch.tensor([-2.0, -2.0, -2.0])  # u = (1, -1, 0)
    labels = torch.tensor([True, False, False])
    sig = lambda x: 1 / (1 + torch.exp(-torch.tensor(x)))
    # kto, beta 1, z0 = 0.5: desirable 1 - σ(1 - 0.5); undesirable 1 - σ(0.5 - u)
    got = kto_loss(logps, ref, labels, 0.5, beta=1.0, desirable_weight=2.0, undesirable_weight=0.5)
    expected = torch.stack([2.0 * (1 - sig(0.5)), 0.5 * (1 - sig(1.5)), 0.5 * (1 - sig(0.5))])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, torch.tensor([0.7551, 0.0912, 0.1888]), atol=1e-4, rtol=0)  # by hand
    # a negative KL estimate is clamped to 0 (TRL's clamp(min=0)); the estimate is never differentiated
    torch.testing.assert_close(kto_loss(logps, ref, labels, -3.0), kto_loss(logps, ref, labels, 0.0))
    # apo_zero_unpaired: 1 - σ(βu) if desirable, σ(βu) if not; the KL estimate is ignored
    apo = kto_loss(logps, ref, labels, 9.0, loss_type="apo_zero_unpaired", beta=1.0)
    torch.testing.assert_close(apo, torch.stack([1 - sig(1.0), sig(-1.0), sig(0.0)]))
    # the KL terms: sums and counts that add over micro-batches and ranks
    terms = kto_kl_terms(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])) + kto_kl_terms(
        torch.tensor([0.0]), torch.tensor([-2.0])
    )
    torch.testing.assert_close(kto_kl(terms), torch.tensor((0.5 - 1.0 + 2.0) / 3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "sigmoid"}, "loss_type='sigmoid'"),
        ({"beta": 0.0}, "beta=0.0"),
        ({"desirable_weight": -1.0}, "desirable_weight=-1.0"),
        ({"kl": None}, "needs the KL estimate"),
    ],
)
def test_invalid_loss_options_name_the_value(kwargs, match):
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=match):
        kto_loss(x, x, torch.tensor([True, False]), **{"kl": 0.0, **kwargs})


def test_invalid_module_options_are_rejected():
    with pytest.raises(ValueError, match="cannot be precomputed"):
        KTOModule(tiny_llama(0), precompute_ref_log_probs=True, sync_ref_model=True)
    with pytest.raises(ValueError, match="precompute_ref_batch_size=0"):
        KTOModule(tiny_llama(0), precompute_ref_batch_size=0)
    with pytest.raises(ValueError, match="loss_type='bco'"):
        KTOModule(tiny_llama(0), loss_type="bco")


# ---------------------------------------------------------------------------------------------------- TRL parity
def _trl_trainer(policy, ref, tokenizer, tmp_path, batch_size: int | None = None, **options):
    args = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=batch_size or len(ROWS["prompt"]),
        max_length=48,
        **options,
    )
    return trl.KTOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=args,
        train_dataset=Dataset.from_dict(ROWS),
        processing_class=tokenizer,
    )


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _ours(policy, ref, batch, dtype=torch.float32, **options):
    module = KTOModule(copy.deepcopy(policy).to(dtype), ref_model=copy.deepcopy(ref).to(dtype), **options)
    module.train()
    loss, metrics = module.compute_loss(dict(batch), None)
    loss.backward()
    return loss.detach(), _grads(module.model), metrics


@pytest.fixture(scope="module")
def policy_and_reference():
    """The tiny preset as the policy, and a perturbed copy as the reference, so that the log-ratios differ from 0 and
    the mismatched rows' mean log-ratio is positive (the KL estimate is not clamped to 0: checked below)."""
    policy = load_model("tiny")
    torch.manual_seed(0)
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, ref


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_loss_gradients_metrics_and_rows_match_trl(loss_type, tokenizer, policy_and_reference, tmp_path):
    policy, ref = policy_and_reference
    options = {"loss_type": loss_type, "beta": 0.5, "desirable_weight": 1.3, "undesirable_weight": 0.7}
    trainer = _trl_trainer(policy, ref, tokenizer, tmp_path, **options)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS["prompt"]))])
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, dict(batch))
    trl_loss.backward()
    trl_grads = _grads(trainer.model)

    ours_batch = _all_rows(_datamodule(tokenizer, ROWS))
    for key, value in batch.items():  # the same ids, masks, labels, and (kto) the same mismatched rows
        assert torch.equal(ours_batch[key], value.to(ours_batch[key].dtype)), key
    assert ("KL_input_ids" in batch) == (loss_type == "kto")
    loss, grads, metrics = _ours(policy, ref, ours_batch, **options)
    loss64, grads64, _ = _ours(policy, ref, ours_batch, torch.float64, **options)
    # a real mistake: the two weights swapped
    swapped = dict(options, desirable_weight=0.7, undesirable_weight=1.3)
    wrong_loss, wrong_grads, _ = _ours(policy, ref, ours_batch, **swapped)
    # tolerance: our float32 loss/gradient against its float64 twin (helpers/rounding.py), measured about 1e-7
    values = lambda x: {"loss": x.reshape(1)}
    Rounding.of(values(loss), values(loss64), what="loss").check(
        values(loss), values(trl_loss.detach()), mistake=relative_l2(values(wrong_loss), values(loss))
    )
    Rounding.of(grads, grads64, what="gradient").check(grads, trl_grads, mistake=relative_l2(wrong_grads, grads))

    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k not in ("num_tokens", "entropy")}
    assert set(trl_metrics) == set(KTO_METRIC_NAMES)
    if loss_type == "kto":
        assert trl_metrics["kl"] > 0.01  # the estimate is really used (not clamped to 0)
    for name, value in trl_metrics.items():  # the same forward: equal up to float32 summation order
        assert float(metrics[name]) == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_kl_partners_are_trls_per_row_and_sequential_batches_equal_trls(tokenizer, policy_and_reference, tmp_path):
    """TRL fixes each row's KL completion at preprocessing (rotation by one inside chunks of the per-device batch
    size, here 4 over 6 rows: chunks of 4 and 2); ours is the same column, and a sequential micro-batch is TRL's."""
    policy, ref = policy_and_reference
    trainer = _trl_trainer(policy, ref, tokenizer, tmp_path, batch_size=4)
    dm = _datamodule(tokenizer, ROWS, batch_size=4)
    dm.setup("fit")
    assert dm.train_dataset["KL_completion_ids"] == trainer.train_dataset["KL_completion_ids"]
    assert dm.train_dataset["KL_completion_ids"] != dm.train_dataset["completion_ids"]
    ours = next(iter(dm.train_dataloader()))
    theirs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert set(theirs) <= set(ours)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value.to(ours[key].dtype)), key
    # our one deliberate fix: a last chunk of ONE row (TRL: its own completion) takes the row before's completion
    assert kl_partner_completions([[1], [2], [3], [4], [5], [6], [7]], 3)[-1] == [6]


# ------------------------------------------------------------------------------------------------- accumulation
def _one_step(tokenizer, loss_type: str, batch_size: int, accumulate: int) -> dict[str, torch.Tensor]:
    module = KTOModule(tiny_llama(0), ref_model=tiny_llama(1), loss_type=loss_type, beta=0.5, learning_rate=1e-3)
    capture = GradCapture()
    dm = _datamodule(tokenizer, UNEVEN, batch_size=batch_size)
    _trainer(1, [capture], accumulate_grad_batches=accumulate).fit(module, datamodule=dm)
    return capture.grads[0]


def _independent_logps(model, ids, attention, completion):
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    token = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (token * completion[:, 1:]).sum(-1)


def _independent_gradient(batches, rows: int):
    """The gradient of the mean over the first ``rows`` examples of KTO's loss (beta 0.5), one backward; each example
    uses the KL estimate of its own micro-batch's mismatched rows, as KTOModule and TRL do."""

    def gradient(policy):
        ref = tiny_llama(1).to(next(policy.parameters()).dtype)
        total, seen = 0.0, 0
        for batch in batches:
            with torch.no_grad():
                kl_rows = (batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
                z0 = (_independent_logps(policy, *kl_rows) - _independent_logps(ref, *kl_rows)).mean().clamp(min=0)
                rho = _independent_logps(ref, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
            pi = _independent_logps(policy, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
            u, keep = pi - rho, min(len(pi), rows - seen)
            loss = torch.where(batch["label"], 1 - torch.sigmoid(0.5 * (u - z0)), 1 - torch.sigmoid(0.5 * (z0 - u)))
            total, seen = total + loss[:keep].sum(), seen + keep
        (total / rows).backward()
        return {name: p.grad.clone() for name, p in policy.named_parameters()}

    return gradient


def test_accumulation_gives_the_full_batch_gradient(tokenizer):
    """Micro-batches of 3, 3 and 2 examples (a mean of micro-batch means would weight the last two 4/3 too much):
    the step's gradient is the mean over the 8 examples, for kto (each micro-batch with its own KL estimate, as TRL)
    and apo_zero_unpaired (no estimate: the same as one batch of 8)."""
    accumulated = _one_step(tokenizer, "kto", batch_size=3, accumulate=3)
    dm = _datamodule(tokenizer, UNEVEN, batch_size=3)
    dm.setup("fit")
    batches = [dm._collate([dm.train_dataset[i] for i in range(s, min(s + 3, 8))], True) for s in (0, 3, 6)]
    reference = calibrated(
        _independent_gradient(batches, 8), tiny_llama(0), mistake=_independent_gradient(batches, 7), what="KTO"
    )
    reference.check(accumulated)

    apo_accumulated = _one_step(tokenizer, "apo_zero_unpaired", batch_size=3, accumulate=3)
    apo_full = _one_step(tokenizer, "apo_zero_unpaired", batch_size=8, accumulate=1)
    # the same size of a real mistake as for kto: one of the 8 examples lost
    reference.rounding.check(apo_accumulated, apo_full, mistake=reference.mistake)


# ------------------------------------------------------------------------------------ precomputed reference
def test_precomputed_reference_equals_the_live_one_and_is_released(tokenizer):
    """7 rows, micro-batches of 3 drawn at random (not TRL's sequential order) and a last chunk of one row: every row
    still has a mismatched partner, the precompute pass scores every row AND its partner once at fit start, frees the
    reference model, and the stored values give the live reference's loss and gradient on the same rows."""
    rows = {key: values[:7] for key, values in UNEVEN.items()}
    dm = _datamodule(tokenizer, rows, batch_size=3, sampling="random")
    module = KTOModule(tiny_llama(0), ref_model=tiny_llama(1), beta=0.5, precompute_ref_log_probs=True)
    capture = GradCapture()
    _trainer(1, [capture]).fit(module, datamodule=dm)
    assert module.ref_model is None and module._precomputed.released  # freed after the pass, as DPOModule
    data = dm.train_dataset
    assert all(a != b for a, b in zip(data["KL_completion_ids"], data["completion_ids"]))  # all mismatched
    assert len(data[REF_KEY]) == len(data[REF_KL_KEY]) == 7
    batch = dm._collate([data[i] for i in (6, 2, 4)], True)  # an arbitrary (not sequential) micro-batch
    assert REF_KEY in batch and REF_KL_KEY in batch
    live_batch = {k: v for k, v in batch.items() if k not in (REF_KEY, REF_KL_KEY)}

    def loss_and_grads(b, dtype=torch.float32):
        m = KTOModule(tiny_llama(0).to(dtype), ref_model=tiny_llama(1).to(dtype), beta=0.5)
        loss, _ = m.compute_loss(dict(b), None)
        loss.backward()
        return {"loss": loss.detach().reshape(1)}, _grads(m.model)

    live_loss, live_grads = loss_and_grads(live_batch)
    live_loss64, live_grads64 = loss_and_grads(live_batch, torch.float64)
    pre_loss, pre_grads = loss_and_grads(batch)  # the batch's precomputed values are used, not its ref_model
    # a real mistake: the partner's reference log-probs taken for the row's (and the reverse)
    swapped = dict(batch, **{REF_KEY: batch[REF_KL_KEY], REF_KL_KEY: batch[REF_KEY]})
    wrong_loss, wrong_grads = loss_and_grads(swapped)
    # tolerance: float32 vs float64 twin of the live computation (helpers/rounding.py); padding differs between the
    # precompute pass (2B rows of an eval batch) and the step, which only changes float32 rounding
    Rounding.of(live_loss, live_loss64, what="loss").check(
        pre_loss, live_loss, mistake=relative_l2(wrong_loss, live_loss)
    )
    Rounding.of(live_grads, live_grads64, what="gradient").check(
        pre_grads, live_grads, mistake=relative_l2(wrong_grads, live_grads)
    )


# -------------------------------------------------------------------------------------------------- data module
def test_unpaired_rows_paired_rows_and_the_builtin_task(tokenizer):
    paired = {"prompt": ["1+1=", "2+2="], "chosen": ["2", "4"], "rejected": ["3", "5"]}
    unpaired = unpair_rows(Dataset.from_dict(paired))
    assert unpaired["completion"] == ["2", "4", "3", "5"] and unpaired["label"] == [True, True, False, False]  # TRL
    implicit = unpair_rows(Dataset.from_dict({"chosen": ["1+1=2"], "rejected": ["1+1=3"]}))
    assert implicit["prompt"] == ["1+1=", "1+1="] and implicit["completion"] == ["2", "3"]

    # paired data given to the data module is unpaired: the same tokens as the unpaired rows
    dm_paired = _datamodule(tokenizer, paired, batch_size=4)
    dm_unpaired = _datamodule(tokenizer, unpaired.to_dict(), batch_size=4)
    for key, value in _all_rows(dm_paired).items():
        assert torch.equal(value, _all_rows(dm_unpaired)[key]), key
    batch = _all_rows(dm_paired)
    completion = batch["input_ids"][0][batch["completion_mask"][0].bool()]
    assert tokenizer.decode(completion) == "2" + tokenizer.eos_token  # EOS appended, as TRL
    # the KL rows: each prompt with the previous row's completion (TRL's rotation)
    kl_text = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(batch["KL_input_ids"], batch["KL_completion_mask"])
    ]
    assert kl_text == ["5", "2", "4", "3"]

    held_out = addition_unpaired_rows("validation")  # the 500 held-out problems: thumbs up, then thumbs down
    assert held_out["label"] == [True] * 500 + [False] * 500
    assert held_out["completion"][:500] == held_out["answer"][:500]
    assert all(c != a for c, a in zip(held_out["completion"][500:], held_out["answer"][500:]))  # near misses
    assert held_out["prompt"][:500] == held_out["prompt"][500:]
    assert UnpairedPreferenceDataModule.builtin["builtin:addition"] is addition_unpaired_rows


def test_malformed_rows_and_missing_columns_are_named(tokenizer):
    bad_label = dict(ROWS, label=[1, 0, 1, 0, 1, 0])  # ints, not bools
    with pytest.raises(ValueError, match=r"row 0 of the train data, column 'label'.*bool label"):
        _datamodule(tokenizer, bad_label).setup("fit")
    with pytest.raises(ValueError, match="no 'label' column"):
        _datamodule(tokenizer, {"prompt": ["a"], "completion": ["b"]}).setup("fit")
    assert UnpairedCollator(0, 4)([{"prompt_ids": [5, 6, 7], "completion_ids": [8, 9], "label": False}])[
        "input_ids"
    ].tolist() == [[5, 6, 7, 8]]  # keep_start truncation to max_length


# ---------------------------------------------------------------------------------------------- fit and resume
def _fit(tokenizer, steps: int, root, ckpt_path=None, save_every=None) -> KTOModule:
    module = KTOModule(tiny_llama(0), learning_rate=1e-3, beta=0.5)
    dm = UnpairedPreferenceDataModule(
        tokenizer=tokenizer, dataset=Dataset.from_dict(UNEVEN), val_size=2, max_length=48, batch_size=2
    )
    callbacks = [ExactResume()]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1))
    trainer = _trainer(
        steps,
        callbacks,
        enable_checkpointing=bool(save_every),
        default_root_dir=root,
        limit_val_batches=None,
        val_check_interval=2,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    if ckpt_path is None:
        assert {f"val_{name}" for name in KTO_METRIC_NAMES} | {"val_loss"} <= set(trainer.callback_metrics)
    return module


@pytest.mark.slow
def test_fit_trains_and_resumes_exactly(tokenizer, tmp_path):
    straight = _fit(tokenizer, 4, tmp_path / "a", save_every=2)
    assert not torch.equal(straight.model.model.embed_tokens.weight, tiny_llama(0).model.embed_tokens.weight)
    ref = tiny_llama(0).state_dict()  # the reference never moves
    assert all(torch.equal(v, ref[k]) for k, v in straight.ref_model.state_dict().items())
    checkpoint = next((tmp_path / "a").glob("*step=2.ckpt"))
    resumed = _fit(tokenizer, 4, tmp_path / "b", ckpt_path=str(checkpoint))
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------------------- DDP
@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_ranks_share_the_kl_estimate_and_give_the_full_batch_gradient(ddp_world):
    """2 ranks x 2 rows: the KL estimate is the mean over both ranks' mismatched rows (TRL gathers it), and the step's
    gradient is the mean over the 4 examples, computed independently in one process from the batches the ranks saw."""
    out = ddp_world.part("kto")  # tests/scripts/ddp_kto.py
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    batches = [r["batch"] for r in ranks]
    assert not torch.equal(batches[0]["input_ids"][0], batches[1]["input_ids"][0])  # each rank its own rows

    def gradient(policy, per_rank: bool = False):  # mean over the 4 examples, one z0 from all 4 mismatched rows
        ref = tiny_llama(1).to(next(policy.parameters()).dtype)
        with torch.no_grad():
            diffs = []
            for batch in batches:
                kl_rows = (batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
                diffs.append(_independent_logps(policy, *kl_rows) - _independent_logps(ref, *kl_rows))
            z0s = [d.mean().clamp(min=0) for d in diffs] if per_rank else [torch.cat(diffs).mean().clamp(min=0)] * 2
        total = 0.0
        for batch, z0 in zip(batches, z0s):
            rows = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
            with torch.no_grad():
                rho = _independent_logps(ref, *rows)
            u = _independent_logps(policy, *rows) - rho
            total = (
                total
                + torch.where(
                    batch["label"], 1 - torch.sigmoid(0.5 * (u - z0)), 1 - torch.sigmoid(0.5 * (z0 - u))
                ).sum()
            )
        (total / 4).backward()
        return {name: p.grad.clone() for name, p in policy.named_parameters()}

    # a real mistake: each rank with its own KL estimate (no all-reduce)
    reference = calibrated(
        gradient, tiny_llama(0), mistake=lambda m: gradient(m, per_rank=True), what="KTO DDP gradient"
    )
    for r in ranks:
        reference.check(r["grads"])


def test_defaults_are_trl_kto_config_defaults():
    fields = {f.name: f.default for f in trl.KTOConfig.__dataclass_fields__.values()}
    ours = {name: p.default for name, p in inspect.signature(KTOModule.__init__).parameters.items() if name in fields}
    assert set(ours) >= {"loss_type", "beta", "desirable_weight", "undesirable_weight", "learning_rate"}
    assert ours == {name: fields[name] for name in ours}


def test_lora_reference_is_the_adapter_disabled_policy(tokenizer):
    """With ``peft_config`` and no ``ref_model`` there is no copy: the reference is the policy with its adapters off,
    so at the start (LoRA's B = 0) every log-ratio, reward and the KL estimate is exactly 0; after a step, not."""
    pytest.importorskip("peft")
    module = KTOModule(tiny_llama(0), peft_config={"r": 4, "target_modules": "all-linear"}, beta=0.5)
    assert type(module.ref_model).__name__ == "AdapterReference"
    batch = _all_rows(_datamodule(tokenizer, ROWS))
    loss, metrics = module.compute_loss(dict(batch), None)
    assert metrics["rewards/chosen"] == 0 and metrics["rewards/rejected"] == 0 and metrics["kl"] == 0
    assert loss.item() == pytest.approx(0.5)  # 1 - σ(0) for every example
    loss.backward()
    torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=10.0).step()
    _, metrics = module.compute_loss(dict(batch), None)
    assert metrics["rewards/chosen"] != 0


def test_kto_refuses_a_batch_of_one_at_setup(tokenizer):
    module = KTOModule(tiny_llama(0))
    with pytest.raises(ValueError, match=r"batch_size=1: .*>= 2 rows"):
        _trainer(1).fit(module, datamodule=_datamodule(tokenizer, ROWS, batch_size=1))
