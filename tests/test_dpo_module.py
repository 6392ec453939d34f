"""DPOModule end to end: frozen reference, loss/metrics vs an independent implementation, accumulation exactness,
precomputed reference log-probs (equal curve, lower memory, cache keying, resume), TR-DPO, options, the recipe config.

Independent implementation used throughout: per-sequence log-probs = Σ over shifted completion positions of
``log_softmax(logits[:, :-1])[next token]`` (a full log-softmax, unlike the module's row-by-row path).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import yaml
from datasets import Dataset
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy

from helpers.accumulation import GradCapture, calibrated
from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.data import builtin
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.modules.dpo import DPOModule
from lit_trainer.modules.reference import _ref_logps

ROOT = Path(__file__).resolve().parents[1]
BETA = 0.1
# the metrics DPOModule logs for every training step (and with a ``val_`` prefix for validation)
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)
ROWS = builtin.preference_rows("train").select(range(96))
# uneven prompt and completion lengths, so the two accumulation layouts pad differently
UNEVEN = {
    "prompt": ["1+2=", "100+200=", "5=", "a much longer prompt=", "7+8=", "x=", "12+12=", "what is 3+4="],
    "chosen": ["3", "300", "5", "ok", "15", "a longer chosen answer", "24", "7"],
    "rejected": ["4", "301", "six", "not ok at all", "16", "b", "42", "seven"],
}


def datamodule(tokenizer, rows=None, **kw) -> PreferenceDataModule:
    kw = {"val_size": 0, "max_length": 48, "batch_size": 16, **kw}
    return PreferenceDataModule(tokenizer=tokenizer, dataset=rows if rows is not None else ROWS.select(range(64)), **kw)


def trainer(steps: int, callbacks=(), **kw) -> pl.Trainer:
    kw = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
        "num_sanity_val_steps": 0,
        **kw,
    }
    return pl.Trainer(max_steps=steps, callbacks=list(callbacks), **kw)


def independent_logps(model, batch):
    """``(2B,)`` completion log-prob sums, the ``(2B, T-1)`` token log-probs and the shifted completion mask."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64: the calibration
    token = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["completion_mask"][:, 1:].float()
    return (token * mask).sum(-1), token * mask, mask


def all_pairs(dm: PreferenceDataModule, split: str = "train"):
    data = dm.split_dataset(split)
    return dm._collate([data[i] for i in range(len(data))], False)


class Recorder(Callback):
    """Step losses, the bytes of every parameter the module holds, and weights per optimizer step."""

    def __init__(self, snapshots: bool = False) -> None:
        self.losses, self.held_bytes, self.snapshots, self.keep = [], [], {}, snapshots

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.held_bytes.append(sum(p.numel() * p.element_size() for p in pl_module.parameters()))
        if self.keep:
            ref = pl_module.ref_model
            self.snapshots[trainer.global_step] = (
                {n: p.detach().clone() for n, p in pl_module.model.named_parameters()},
                {n: p.detach().clone() for n, p in ref.named_parameters()} if ref is not None else None,
            )


@pytest.mark.slow
def test_end_to_end_reference_is_frozen_and_rewards_accuracy_rises(tokenizer):
    torch.manual_seed(0)
    module = DPOModule("tiny-64", learning_rate=1e-3, scheduler="constant", beta=BETA)
    ref_before = {n: p.detach().clone() for n, p in module.ref_model.named_parameters()}
    dm = datamodule(tokenizer, validation_dataset=ROWS.select(range(64, 96)), eval_batch_size=32)
    fit = trainer(24, log_every_n_steps=4, val_check_interval=24, check_val_every_n_epoch=None)
    fit.fit(module, datamodule=dm)

    ref = module.ref_model
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(p, ref_before[n]) for n, p in ref.named_parameters())  # never trained
    optimized = {id(p) for group in fit.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.model.parameters()}  # the reference is not in the optimizer
    assert not optimized & {id(p) for p in ref.parameters()}
    # rewards/accuracies on the 64 training pairs, recomputed independently: 0 before (u_c = u_r = 0, strict >)
    batch = all_pairs(dm)
    with torch.no_grad():
        pi, ref_lp = independent_logps(module.model, batch)[0], independent_logps(ref, batch)[0]
    u = pi - ref_lp
    accuracy = float((u[:64] > u[64:]).float().mean())
    assert accuracy > 0.6, accuracy
    logged = fit.callback_metrics
    for name in METRICS:
        assert name in logged and f"val_{name}" in logged, name
    assert float(logged["rewards/accuracies"]) > 0.5
    # val_loss = mean over the 32 validation pairs of -logsigmoid(β(u_c - u_r)) at the final weights
    val = all_pairs(dm, "validation")
    with torch.no_grad():
        v = independent_logps(module.model, val)[0] - independent_logps(ref, val)[0]
    expected = -F.logsigmoid(BETA * (v[:32] - v[32:])).mean()
    torch.testing.assert_close(logged["val_loss"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged["val_rewards/accuracies"], (v[:32] > v[32:]).float().mean())


def test_loss_and_metrics_match_an_independent_implementation(tokenizer):
    policy, ref = tiny_llama(0), tiny_llama(1)
    module = DPOModule(
        policy, ref_model=ref, loss_type=["sigmoid", "ipo", "sft"], loss_weights=[1.0, 0.5, 2.0], beta=BETA
    )
    dm = datamodule(tokenizer, Dataset.from_dict(UNEVEN))
    dm.setup("fit")
    batch = all_pairs(dm)
    with torch.no_grad():
        loss, metrics = module.compute_loss(dict(batch), None)
        summed, _ = module.compute_loss(dict(batch), torch.tensor([16.0, 40.0]))  # step counts: pairs, chosen tokens
        with pytest.raises(ValueError, match="needs two counts"):  # a pairs-only count cannot normalise "sft"
            module.compute_loss(dict(batch), torch.tensor(16.0))
        pi, token, mask = independent_logps(policy, batch)
        rho = independent_logps(ref, batch)[0]
    n = batch["completion_mask"].sum(-1).float()  # unshifted completion lengths
    pc, pr, rc, rr = pi[:8], pi[8:], rho[:8], rho[8:]
    sigmoid = -F.logsigmoid(BETA * ((pc - rc) - (pr - rr)))
    ipo = ((pc - rc) / n[:8] - (pr - rr) / n[8:] - 1 / (2 * BETA)) ** 2
    nll = -token[:8].sum()  # summed NLL of every chosen completion token
    per_pair = 1.0 * sigmoid + 0.5 * ipo
    # TRL's definition: sft is the token mean over ALL chosen completion tokens of the batch
    torch.testing.assert_close(loss, per_pair.mean() + 2.0 * nll / mask[:8].sum(), rtol=1e-5, atol=1e-6)
    # with step counts: Σ_i ℓ_i / global pairs + w · Σ chosen-token NLL / global chosen tokens
    torch.testing.assert_close(summed, per_pair.sum() / 16 + 2.0 * nll / 40, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["rewards/chosen"], (BETA * (pc - rc)).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["rewards/margins"], (BETA * (pc - rc - pr + rr)).mean(), rtol=1e-5, atol=1e-6)
    assert float(metrics["rewards/accuracies"]) == float(((pc - rc) > (pr - rr)).float().mean())
    torch.testing.assert_close(metrics["logps/rejected"], pr.mean(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # token mean over chosen completion positions of the vocabulary-mean logit
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        vocab_mean = logits[:, :-1].mean(-1)
    torch.testing.assert_close(metrics["logits/chosen"], (vocab_mean * mask)[:8].sum() / mask[:8].sum())
    assert set(metrics) == set(METRICS)


def _one_step_gradient(
    tokenizer, batch_size: int, accumulate: int, loss_type=("sigmoid", "sft", "ipo"), **kw
) -> dict[str, torch.Tensor]:
    module = DPOModule(tiny_llama(0), loss_type=list(loss_type), beta=BETA, learning_rate=1e-3)
    capture = GradCapture()
    dm = datamodule(tokenizer, Dataset.from_dict(UNEVEN), batch_size=batch_size, sampling="sequential")
    trainer(1, [capture], accumulate_grad_batches=accumulate, **kw).fit(module, datamodule=dm)
    return capture.grads[0]


def independent_gradient(batch, pairs: int, losses=("sigmoid", "sft", "ipo")):
    """The independent full-batch gradient of the first ``pairs`` pairs of ``batch`` (chosen rows, then the 8
    rejected ones): mean over the pairs of the pair losses, TRL's sft term (the token mean over all their chosen
    tokens), one backward; the reference is ``tiny_llama(0)`` in the policy's dtype. A function of the policy, for
    :func:`helpers.accumulation.calibrated` (float64 policy: the float64 twin)."""

    def gradient(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        ref = tiny_llama(0).to(next(policy.parameters()).dtype)
        pi, token, mask = independent_logps(policy, batch)
        with torch.no_grad():
            rho = independent_logps(ref, batch)[0]
        count = batch["completion_mask"].sum(-1).to(pi.dtype)
        u, c, r = pi - rho, slice(0, pairs), slice(8, 8 + pairs)
        loss = -F.logsigmoid(BETA * (u[c] - u[r]))
        if "ipo" in losses:
            loss = loss + (u[c] / count[c] - u[r] / count[r] - 1 / (2 * BETA)) ** 2
        loss = loss.mean()
        if "sft" in losses:  # token mean over all chosen tokens of the step
            loss = loss - token[c].sum() / mask[c].sum()
        loss.backward()
        return {name: p.grad.clone() for name, p in policy.named_parameters()}

    return gradient


def test_gradient_accumulation_gives_the_full_batch_gradient(tokenizer):
    # micro-batches of 3, 3 and 2 pairs: a mean of per-micro-batch means would weight the last two pairs 4/3 too much
    accumulated = _one_step_gradient(tokenizer, batch_size=3, accumulate=3)
    halves = _one_step_gradient(tokenizer, batch_size=4, accumulate=2)  # 2 micro-batches of 4 pairs
    full = _one_step_gradient(tokenizer, batch_size=8, accumulate=1)
    # and the independent full-batch loss: mean over the 8 pairs of sigmoid + sft + ipo, one backward. Tolerance:
    # its float32 rounding against its float64 twin (helpers/rounding.py), for every comparison of two float32
    # evaluations of this mathematics (module or independent); a real mistake: the last pair lost
    dm = datamodule(tokenizer, Dataset.from_dict(UNEVEN))
    dm.setup("fit")
    batch = all_pairs(dm)
    reference = calibrated(
        independent_gradient(batch, 8), tiny_llama(0), mistake=independent_gradient(batch, 7), what="DPO gradient"
    )
    assert set(accumulated) == set(reference.grads)  # only the policy receives gradients
    reference.rounding.check(accumulated, full, mistake=reference.mistake)
    reference.rounding.check(halves, full, mistake=reference.mistake)
    reference.check(accumulated)


def test_rpo_sft_term_is_the_token_mean_over_the_step_under_accumulation(tokenizer):
    """RPO (``["sigmoid", "sft"]``): chosen completions of 1 to 22 tokens in micro-batches of 3, 3 and 2 pairs; the
    step equals one full batch with TRL's sft term (mean NLL over every chosen token of the step)."""
    dm = datamodule(tokenizer, Dataset.from_dict(UNEVEN))
    dm.setup("fit")
    batch = all_pairs(dm)
    chosen = batch["completion_mask"][:8, 1:].sum(-1)
    assert int(chosen.max()) > 5 * int(chosen.min())  # really uneven
    rpo = ("sigmoid", "sft")
    # calibrated as above (helpers/rounding.py); a real mistake: the last pair lost
    independent = calibrated(
        independent_gradient(batch, 8, rpo), tiny_llama(0), mistake=independent_gradient(batch, 7, rpo), what="RPO"
    )
    independent.check(_one_step_gradient(tokenizer, 3, 3, rpo))
    # limit_train_batches=2 cuts the window: the step is the first 6 pairs only (a real mistake: the uncut 8)
    cut = calibrated(
        independent_gradient(batch, 6, rpo), tiny_llama(0), mistake=independent_gradient(batch, 8, rpo), what="cut"
    )
    cut.check(_one_step_gradient(tokenizer, 3, 3, rpo, limit_train_batches=2))


@pytest.mark.slow
def test_precompute_matches_live_reference_with_less_memory_and_a_keyed_cache(tokenizer, tmp_path, monkeypatch):
    def run(seed: int, precompute: bool, rows=None, steps: int = 6) -> tuple[DPOModule, Recorder]:
        recorder = Recorder()
        module = DPOModule(
            tiny_llama(seed),
            learning_rate=1e-3,
            beta=BETA,
            precompute_ref_log_probs=precompute,
            ref_logps_cache_dir=str(tmp_path / "cache"),
        )
        pl.seed_everything(seed)
        trainer(steps, [recorder]).fit(module, datamodule=datamodule(tokenizer, rows))
        return module, recorder

    live_module, live = run(0, precompute=False)
    pre_module, pre = run(0, precompute=True)
    torch.testing.assert_close(torch.tensor(pre.losses), torch.tensor(live.losses), rtol=1e-5, atol=1e-6)
    assert pre_module.ref_model is None and live_module.ref_model is not None
    policy_bytes = sum(p.numel() * p.element_size() for p in pre_module.model.parameters())
    # memory held during training: the live run carries a second copy of every weight, the precompute run none
    assert live.held_bytes[-1] == 2 * policy_bytes and pre.held_bytes[-1] == policy_bytes
    print(
        f"\nparameter bytes held while training: live reference {live.held_bytes[-1]}, precomputed {pre.held_bytes[-1]}"
    )
    files = sorted((tmp_path / "cache").glob("ref_logps-*.safetensors"))
    assert len(files) == 1
    # same model and data: loaded from the cache, no reference pass
    monkeypatch.setattr(_ref_logps, "score_pairs", lambda *a, **k: pytest.fail("recomputed despite the cache"))
    run(0, precompute=True, steps=1)
    monkeypatch.undo()
    run(1, precompute=True, steps=1)  # another reference model -> a new key
    run(0, precompute=True, rows=ROWS.select(range(1, 65)), steps=1)  # other data -> a new key
    assert len(list((tmp_path / "cache").glob("ref_logps-*.safetensors"))) == 3


@pytest.mark.slow
def test_precompute_survives_a_resume_from_checkpoint(tokenizer, tmp_path):
    def module() -> DPOModule:  # constant LR: the 2-step run must follow the same schedule as the 4-step ones
        return DPOModule(
            tiny_llama(0), learning_rate=1e-3, beta=BETA, precompute_ref_log_probs=True, scheduler="constant"
        )

    pl.seed_everything(0)
    straight = module()
    trainer(4).fit(straight, datamodule=datamodule(tokenizer))
    pl.seed_everything(0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    first = module()
    trainer(2, [checkpoints], enable_checkpointing=True).fit(first, datamodule=datamodule(tokenizer))
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)
    assert saved[_ref_logps.CKPT_KEY]["train"]["chosen"].shape == (64,)
    assert not any(k.startswith("ref_model.") for k in saved["state_dict"])
    # the resumed policy is trained, so it cannot serve as reference again: the checkpoint's log-probs are used
    resumed = module()
    trainer(4).fit(resumed, datamodule=datamodule(tokenizer), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_sync_ref_model_mixes_exactly_every_n_steps(tokenizer):
    module = DPOModule(
        tiny_llama(0),
        learning_rate=1e-2,
        beta=BETA,
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_mixup_alpha=0.6,
    )
    ref0 = {n: p.detach().clone() for n, p in module.ref_model.named_parameters()}
    recorder = Recorder(snapshots=True)
    trainer(4, [recorder]).fit(module, datamodule=datamodule(tokenizer))
    snap = recorder.snapshots

    def mixed(ref, policy):  # TRL's SyncRefModelCallback: ref.mul_(1 - α).add_(policy, alpha=α)
        return {n: ref[n].mul(1 - 0.6).add(policy[n], alpha=0.6) for n in ref}

    assert all(torch.equal(snap[1][1][n], ref0[n]) for n in ref0)  # step 1: untouched
    after2 = mixed(ref0, snap[2][0])
    assert all(torch.equal(snap[2][1][n], after2[n]) for n in ref0)  # step 2: mixed with the step-2 policy
    assert all(torch.equal(snap[3][1][n], after2[n]) for n in ref0)
    after4 = mixed(after2, snap[4][0])
    assert all(torch.equal(snap[4][1][n], after4[n]) for n in ref0)
    assert not all(torch.equal(after4[n], ref0[n]) for n in ref0)
    # hand-computed: ref = 1, policy = 3, α = 0.25 -> 0.75 * 1 + 0.25 * 3 = 1.5
    with torch.no_grad():
        for p in module.ref_model.parameters():
            p.fill_(1.0)
        for p in module.model.parameters():
            p.fill_(3.0)
    module.sync_reference_model(alpha=0.25)
    assert all(bool((p == 1.5).all()) for p in module.ref_model.parameters())
    assert all(bool((p == 3.0).all()) for p in module.model.parameters())


@pytest.mark.parametrize("kwargs, match", [
    ({"loss_type": ["sigmoid", "nope"]}, "loss_type"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "one weight per type"),
    ({"loss_type": ["sigmoid", "nca_pair"], "f_divergence_type": "js_divergence"}, r"loss types \['nca_pair'\]"),
    ({"loss_type": "exo_pair"}, "label_smoothing > 0"),
    ({"beta": 0.0}, "beta must be > 0"),
    ({"ld_alpha": 1.5}, "ld_alpha=1.5"),
    ({"ref_model_mixup_alpha": 2.0}, "alpha must be in"),
    ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "cannot be precomputed"),
])  # fmt: skip
def test_invalid_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPOModule(tiny_llama(0), **kwargs)


def test_reference_options_dropout_and_checkpoint_keys():
    policy = tiny_llama(0, dropout=0.1)
    with pytest.raises(ValueError, match="policy object itself"):
        DPOModule(policy, ref_model=policy)
    module = DPOModule(policy, loss_type=["sigmoid", "sft"], f_divergence_type="alpha_divergence")  # sft allowed
    names = dict(module.model.named_parameters()).keys()
    assert dict(module.ref_model.named_parameters()).keys() == names  # mirrors the policy (BEMA writes by name)
    assert all(m.attention_dropout == 0.0 for m in module.modules() if hasattr(m, "attention_dropout"))
    assert all(
        m.attention_dropout == 0.1
        for m in DPOModule(tiny_llama(0, dropout=0.1), disable_dropout=False).modules()
        if hasattr(m, "attention_dropout")
    )
    module.train()
    assert module.model.training and not module.ref_model.training
    assert "ref_model" not in module.hparams or module.hparams.ref_model is None  # no model object in hparams
    # a checkpoint written after the reference was released loads into a module that still has one, and back
    state = {"state_dict": {k: v for k, v in module.state_dict().items() if not k.startswith("ref_model.")}}
    module.on_load_checkpoint(state)
    module.load_state_dict(state["state_dict"])
    lean = DPOModule(tiny_llama(0), precompute_ref_log_probs=True)
    assert lean.ref_model is None
    full = {"state_dict": dict(module.state_dict())}
    lean.on_load_checkpoint(full)
    lean.load_state_dict(full["state_dict"])


def test_fsdp1_and_deepspeed_are_refused_at_setup():
    module = DPOModule(tiny_llama(0))
    module._trainer = SimpleNamespace(strategy=FSDPStrategy(), gradient_clip_val=None)
    with pytest.raises(ValueError, match=r"FSDPStrategy \(FSDP1\) is not supported.*ModelParallelStrategy"):
        module.setup("fit")
    module._trainer = SimpleNamespace(strategy=type("DeepSpeedStrategy", (), {})(), gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="DeepSpeedStrategy is not supported: the frozen reference"):
        module.setup("fit")


def test_precompute_is_refused_under_model_parallel_but_the_live_reference_is_accepted():
    trainer = SimpleNamespace(strategy=type("ModelParallelStrategy", (), {})(), gradient_clip_val=None)
    module = DPOModule(tiny_llama(0), precompute_ref_log_probs=True)
    module._trainer = trainer
    with pytest.raises(ValueError, match=r"precompute_ref_log_probs=True\)` is not supported under ModelParallel"):
        module.setup("fit")
    live = DPOModule(tiny_llama(0))
    live._trainer = trainer
    live.setup("fit")


@pytest.mark.slow
def test_recipe_config_parses_and_runs(tmp_path, monkeypatch):
    config = yaml.safe_load((ROOT / "configs" / "dpo.yaml").read_text())
    init = config["model"]["init_args"]
    assert (init["loss_type"], init["loss_weights"], init["learning_rate"]) == (["sigmoid", "sft"], [1.0, 1.0], 3e-4)
    assert config["data"]["init_args"]["dataset"] == "builtin:addition"
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS.select(range(40)).to_list()))
    monkeypatch.chdir(tmp_path)
    cli = LitTrainerCLI(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs" / "dpo.yaml"),
            "--model.init_args.model",
            "tiny-64",
            "--data.init_args.dataset",
            str(data),
            "--trainer.max_steps",
            "2",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--data.init_args.batch_size",
            "8",
            "--trainer.limit_val_batches",
            "1",
        ]
    )
    assert cli.trainer.global_step == 2
    assert isinstance(cli.model, DPOModule) and cli.model.loss_types == ["sigmoid", "sft"]
    assert "rewards/accuracies" in cli.trainer.callback_metrics


@pytest.mark.ddp
def test_ddp_two_ranks_precompute_gathers_every_shard_and_matches_live(tokenizer, ddp_world):
    out = ddp_world.part("dpo")  # tests/scripts/ddp_dpo.py
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["precomputed"]["ref_model_freed"] and not r["live"]["ref_model_freed"]
        # the same seed and data: the precomputed reference gives the live-reference loss curve on each rank, bit for
        # bit (the reference scores the same rows in the same batches either way, as in the one-process test)
        assert r["precomputed"]["losses"] == r["live"]["losses"]
        for key in ("val_loss", "val_rewards/accuracies", "val_rewards/margins", "val_logps/chosen"):
            assert r["precomputed"]["metrics"][key] == r["live"]["metrics"][key], key
    assert ranks[0]["ref_columns"] == ranks[1]["ref_columns"]  # both ranks hold every row after the all-gather
    lora = [json.loads((out / f"lora_rank{r}.json").read_text()) for r in (0, 1)]  # LoRA: adapters-off reference
    assert lora[0]["adapters"] == lora[1]["adapters"] and all(r["base_unchanged"] for r in lora)
    assert lora[0]["reference"] == "AdapterReference" and any(
        v != 0 for n, v in lora[0]["adapters"].items() if "lora_B" in n
    )  # the adapters trained
    assert all(".lora_" in k for k in torch.load(out / "lora.ckpt", weights_only=True)["state_dict"])
    # and the gathered rows (rank 0 scored 0, 2, 4, ..., rank 1 scored 1, 3, ...) are the single-process values
    pl.seed_everything(0)
    reference = tiny_llama(0)
    for split, dataset, count in (("train", "train", 21), ("validation", "validation", 5)):
        dm = PreferenceDataModule(
            tokenizer=tokenizer,
            dataset=builtin.preference_rows(dataset).select(range(count)),
            val_size=0,
            max_length=32,
        )
        dm.setup("fit")
        with torch.no_grad():
            logps = independent_logps(reference, all_pairs(dm))[0]
            logps64 = independent_logps(copy.deepcopy(reference).double(), all_pairs(dm))[0]
        gathered = torch.tensor(ranks[0]["ref_columns"][split], dtype=torch.float32)
        # tolerance: the ranks scored their rows in other batches (other padding) than this one-process batch, so only
        # float32 rounding may differ: bounded by this computation's float32-vs-float64 gap; a mistake is a row scored
        # for another pair (the columns shifted by one)
        expected = {"logps": torch.stack([logps[:count], logps[count:]])}
        shifted = {"logps": torch.stack([logps[:count], logps[count:]]).roll(1, dims=1)}
        rounding = Rounding.of({"logps": logps}, {"logps": logps64}, what=f"gathered {split} reference log-probs")
        rounding.check({"logps": gathered}, expected, mistake=relative_l2(shifted, expected))
