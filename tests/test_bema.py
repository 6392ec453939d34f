"""BEMA callback: TRL 1.16 numerics, resume, frozen parameters, evaluate_with_bema, exceptions, reference model."""

from __future__ import annotations

import copy
import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.models import tiny_llama
from lit_trainer.callbacks.bema import BEMA, bema_coefficients

LR = 0.5
A0 = [0.3, -1.2, 2.0]
B0 = [[1.0, 0.5], [-0.25, 4.0]]
VAL_K = np.array([1.0, -2.0, 0.5, 3.0, 1.0, -1.0, 0.25])  # validation metric = VAL_K . (a, b.flatten())


def coefficients(step: int) -> np.ndarray:
    """c_t: the gradient of optimizer step t+1 (the loss is c_t . theta, so SGD adds -LR * c_t)."""
    return np.sin(0.7 * np.arange(7) + 1.3 * step)


def live_trajectory(num_steps: int) -> list[np.ndarray]:
    """theta_0 .. theta_T as flat (a, b) vectors: theta_t = theta_{t-1} - LR * c_{t-1}."""
    thetas = [np.array(A0 + [b for row in B0 for b in row], dtype=np.float64)]
    for t in range(num_steps):
        thetas.append(thetas[-1] - LR * coefficients(t))
    return thetas


def trl_bema(
    thetas: list[np.ndarray],
    *,
    update_freq: int = 400,
    ema_power: float = 0.5,
    bias_power: float = 0.2,
    lag: float = 10,
    update_after: int = 0,
    multiplier: float = 1.0,
    min_ema_multiplier: float = 0.0,
    **_: object,
) -> list[np.ndarray]:
    """Independent implementation of TRL 1.16's BEMACallback (docs/design.md#trl-bema): outputs at steps 0..T."""
    theta0, ema, out = thetas[0].copy(), thetas[0].copy(), thetas[0].copy()
    outputs = [out.copy()]
    for t in range(1, len(thetas)):
        if t == update_after:  # snapshot, no output update
            theta0, ema = thetas[t].copy(), thetas[t].copy()
        elif t > update_after and (t - update_after) % update_freq == 0:
            base = lag + multiplier * t
            beta = max(math.pow(base, -ema_power), min_ema_multiplier)
            alpha = math.pow(base, -bias_power)
            ema = (1.0 - beta) * ema + beta * thetas[t]
            out = ema + alpha * (thetas[t] - theta0)
        outputs.append(out.copy())
    return outputs


def flat(weights: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([weights["a"].flatten(), weights["b"].flatten()]).double().numpy()


class LinearSGD(pl.LightningModule):
    """Trainable a (3,), b (2, 2); a frozen parameter and a frozen submodule; loss c_t . (a, b) at step t."""

    def __init__(self, fail_at_step: int | None = None, fail_mode: str = "raise", mid_val_ckpt: str | None = None):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(A0, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(B0, dtype=torch.float64))
        self.frozen = nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False)
        self.head = nn.Linear(2, 2).double().requires_grad_(False)
        self.fail_at_step, self.fail_mode, self.mid_val_ckpt = fail_at_step, fail_mode, mid_val_ckpt
        self.val_records: list[tuple[int, float]] = []

    def theta(self) -> torch.Tensor:
        return torch.cat([self.a, self.b.flatten()])

    def training_step(self, batch, batch_idx):
        c = torch.from_numpy(coefficients(self.trainer.global_step))
        return (c * self.theta()).sum() + 0.0 * self.head(self.frozen).sum()

    def validation_step(self, batch, batch_idx):
        step = self.trainer.global_step
        metric = (torch.from_numpy(VAL_K) * self.theta()).sum()
        self.val_records.append((step, float(metric)))
        if step == self.fail_at_step and batch_idx == 0:
            if self.fail_mode == "raise":
                raise RuntimeError("boom in validation")
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning raises SIGTERMException after this batch
        if self.mid_val_ckpt and step == 6 and batch_idx == 0:
            self.trainer.save_checkpoint(self.mid_val_ckpt)
        self.log("val_metric", metric)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(3, 1)), batch_size=1)


class Recorder(Callback):
    """After BEMA in the list: records its output (and the live / reference weights) after every optimizer step."""

    def __init__(self, bema: BEMA):
        self.bema, self.bema_at, self.live_at, self.ref_at = bema, {}, {}, {}

    def _record(self, trainer, pl_module) -> None:
        step = trainer.global_step
        self.bema_at[step] = {k: v.clone() for k, v in self.bema.bema_state_dict().items()}
        self.live_at[step] = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
        if getattr(pl_module, "ref_model", None) is not None:
            self.ref_at[step] = {k: v.detach().clone() for k, v in pl_module.ref_model.named_parameters()}

    def on_train_start(self, trainer, pl_module):
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(trainer, pl_module)


def make_trainer(tmp_path: Path, max_steps: int, callbacks: list, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    return pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


CONFIGS = [
    dict(update_freq=1),  # TRL defaults otherwise: lag 10, ema_power 0.5, bias_power 0.2
    dict(update_freq=3, update_after=2, lag=1, multiplier=2.0, apply_at_end=True),
    dict(update_freq=2, update_after=5, ema_power=0.0, bias_power=0.0),  # beta = alpha = 1: theta_t + (theta_t-theta0)
    dict(update_freq=4, lag=0, ema_power=1.5, bias_power=1.0, min_ema_multiplier=0.3),  # beta clamped at 0.3
    dict(),  # update_freq=400: the output stays at the initial weights
    dict(update_freq=2, update_after=3, lag=3.5, multiplier=0.5, accumulate_grad_batches=3),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults")
def test_numerics_match_trl_formulas(tmp_path, config):
    config = dict(config)
    accumulate = config.pop("accumulate_grad_batches", 1)
    steps = 12
    bema = BEMA(**config)
    recorder = Recorder(bema)
    module = LinearSGD()
    make_trainer(tmp_path, steps, [bema, recorder], accumulate_grad_batches=accumulate).fit(module)

    thetas = live_trajectory(steps)
    expected = trl_bema(thetas, **config)
    assert sorted(recorder.bema_at) == list(range(steps + 1))  # one record per optimizer step, not per micro-batch
    assert set(bema.bema_state_dict()) == {"a", "b"}  # frozen parameter and frozen submodule skipped
    for t in range(steps + 1):
        np.testing.assert_allclose(flat(recorder.live_at[t]), thetas[t], rtol=0, atol=1e-12)
        np.testing.assert_allclose(flat(recorder.bema_at[t]), expected[t], rtol=0, atol=1e-12, err_msg=f"step {t}")
    final_live = module.theta().detach().numpy()
    np.testing.assert_allclose(final_live, expected[-1] if config.get("apply_at_end") else thetas[-1], atol=1e-12)
    if config.get("update_freq", 400) < steps:  # the average really moved away from both theta_0 and theta_T
        assert not np.allclose(expected[-1], thetas[0]) and not np.allclose(expected[-1], thetas[-1])


def test_coefficients_by_hand():
    # step 400, TRL defaults: base = 10 + 400 = 410; beta = 410^-0.5 = 1/20.248 = 0.049386;
    # alpha = 410^-0.2 = exp(-0.2 * ln 410) = exp(-0.2 * 6.01616) = exp(-1.203232) = 0.300222
    beta, alpha = bema_coefficients(400, lag=10, multiplier=1.0, ema_power=0.5, bias_power=0.2, min_ema_multiplier=0)
    assert beta == pytest.approx(0.0493865, rel=1e-5) and alpha == pytest.approx(0.300222, rel=1e-5)
    # min_ema_multiplier clamps beta from below: 410^-0.5 < 0.1
    clamped, _ = bema_coefficients(400, lag=10, multiplier=1.0, ema_power=0.5, bias_power=0.2, min_ema_multiplier=0.1)
    assert clamped == 0.1


def test_resume_continues_the_same_average(tmp_path):
    config = dict(update_freq=3, update_after=2, lag=2, ema_power=0.7, bias_power=0.3)
    ckpts = tmp_path / "ckpts"
    full = BEMA(**config)
    saver = ModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    make_trainer(tmp_path / "a", 11, [full, saver], enable_checkpointing=True).fit(LinearSGD())

    ckpt = ckpts / "step=5.ckpt"
    state = torch.load(ckpt, weights_only=True)["callbacks"][full.state_key]  # tensors and primitives only
    assert state["step"] == 5 and state["num_updates"] == 1 and set(state["ema"]) == {"a", "b"}
    resumed = BEMA(**config)
    module = LinearSGD()
    make_trainer(tmp_path / "b", 11, [resumed]).fit(module, ckpt_path=ckpt)

    for key in ("theta0", "ema", "bema"):
        for name in ("a", "b"):
            torch.testing.assert_close(resumed.state_dict()[key][name], full.state_dict()[key][name], rtol=0, atol=0)
    expected = trl_bema(live_trajectory(11), **config)[-1]
    np.testing.assert_allclose(flat(resumed.bema_state_dict()), expected, atol=1e-12)
    # TRL would re-snapshot theta0 at the resumed weights theta_5: a different theta0 and result
    assert not np.allclose(flat(resumed.state_dict()["theta0"]), live_trajectory(5)[5])


def test_evaluate_with_bema_scores_the_bema_weights(tmp_path):
    config = dict(update_freq=2, update_after=1, lag=1, evaluate_with_bema=True)
    bema = BEMA(**config)
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="val_metric", mode="min", save_top_k=1)
    module = LinearSGD(mid_val_ckpt=str(tmp_path / "mid_val.ckpt"))
    trainer = make_trainer(
        tmp_path,
        9,
        [bema, best],
        enable_checkpointing=True,
        limit_val_batches=None,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=1,
    )
    trainer.fit(module)

    thetas, outputs = live_trajectory(9), trl_bema(live_trajectory(9), **config)
    seen = {step: value for step, value in module.val_records}
    assert sorted(seen) == [0, 3, 6, 9]  # sanity check + every 3 optimizer steps
    for step, value in module.val_records:
        assert value == pytest.approx(float(VAL_K @ outputs[step]), abs=1e-12)
        if step > 1:  # the BEMA weights differ from the live ones, so the check can fail
            assert abs(value - float(VAL_K @ thetas[step])) > 1e-3
    np.testing.assert_allclose(module.theta().detach().numpy(), thetas[9], atol=1e-12)  # training used live weights

    best_step = min((v, s) for s, v in seen.items() if s > 0)[1]
    ckpt = torch.load(best.best_model_path, weights_only=True)
    assert ckpt["global_step"] == best_step
    np.testing.assert_allclose(flat(ckpt["state_dict"]), thetas[best_step], atol=1e-12)  # live weights
    np.testing.assert_allclose(
        flat(BEMA.bema_weights_from_checkpoint(best.best_model_path)), outputs[best_step], atol=1e-12
    )
    mid = torch.load(tmp_path / "mid_val.ckpt", weights_only=True)  # saved while the BEMA weights were swapped in
    np.testing.assert_allclose(flat(mid["state_dict"]), thetas[6], atol=1e-12)


@pytest.mark.parametrize("fail_mode", ["raise", "sigterm"])
def test_exception_during_validation_restores_live_weights(tmp_path, fail_mode):
    config = dict(update_freq=2, lag=1, evaluate_with_bema=True)
    bema = BEMA(**config)
    module = LinearSGD(fail_at_step=4, fail_mode=fail_mode)
    trainer = make_trainer(
        tmp_path,
        12,
        [bema, OnExceptionCheckpoint(dirpath=tmp_path)],
        enable_checkpointing=True,
        limit_val_batches=None,
        val_check_interval=2,
        check_val_every_n_epoch=None,
    )
    with pytest.raises(RuntimeError if fail_mode == "raise" else SystemExit):
        trainer.fit(module)

    thetas, outputs = live_trajectory(4), trl_bema(live_trajectory(4), **config)
    assert module.val_records[-1][1] == pytest.approx(float(VAL_K @ outputs[4]), abs=1e-12)  # swapped in when it failed
    np.testing.assert_allclose(module.theta().detach().numpy(), thetas[4], atol=1e-12)  # swapped back
    ckpt = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4
    np.testing.assert_allclose(flat(ckpt["state_dict"]), thetas[4], atol=1e-12)
    np.testing.assert_allclose(
        flat(BEMA.bema_weights_from_checkpoint(tmp_path / "on_exception.ckpt")), outputs[4], atol=1e-12
    )


class PolicyWithRef(pl.LightningModule):
    """An HF policy in `self.model`, a frozen deep copy in `self.ref_model` (the DPOModule layout)."""

    def __init__(self, ref: str = "copy"):
        super().__init__()
        from transformers import ByT5Tokenizer

        self.model = tiny_llama()
        self.ref_model = {
            "copy": lambda: copy.deepcopy(self.model).requires_grad_(False),
            "none": lambda: None,
            "shared": lambda: self.model,
            "trainable": lambda: copy.deepcopy(self.model),
            "other": lambda: nn.Linear(3, 3).requires_grad_(False),
        }[ref]()
        self.tokenizer = ByT5Tokenizer()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(
            TensorDataset(torch.randint(3, 259, (32, 8), generator=torch.Generator().manual_seed(1))), batch_size=4
        )


def test_update_ref_model_schedule_and_hf_export(tmp_path):
    export = tmp_path / "out" / "bema"
    bema = BEMA(
        update_freq=2,
        update_after=1,
        update_ref_model=True,
        ref_model_update_freq=3,
        ref_model_update_after=2,
        export_dir=export,
    )
    recorder = Recorder(bema)
    module = PolicyWithRef()
    make_trainer(tmp_path, 8, [bema, recorder]).fit(module)

    def as_ref(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # rule: strip the `model.` prefix
        return {name.removeprefix("model."): value for name, value in weights.items()}

    assert not any(name.startswith("ref_model.") for name in bema.bema_state_dict())  # frozen: skipped
    for t in range(1, 9):
        ref, previous = recorder.ref_at[t], recorder.ref_at[t - 1]
        if t in (2, 5, 8):  # t >= 2 and (t - 2) % 3 == 0
            for name, value in as_ref(recorder.bema_at[t]).items():
                assert torch.equal(ref[name], value), (t, name)
        else:
            assert all(torch.equal(ref[name], previous[name]) for name in ref), t
    # step 2 precedes the first BEMA update (step 3): the reference gets the initial weights, as in TRL
    initial = as_ref({n: v for n, v in recorder.live_at[0].items() if n.startswith("model.")})
    assert all(torch.equal(recorder.ref_at[2][n], v) for n, v in initial.items())
    emb = "model.embed_tokens.weight"
    assert not torch.equal(recorder.ref_at[5][emb], recorder.ref_at[2][emb])

    from transformers import AutoTokenizer, LlamaForCausalLM

    assert sorted(p.name for p in export.parent.iterdir()) == ["bema"]  # temp dir renamed into place
    hf_model = LlamaForCausalLM.from_pretrained(export)
    reloaded, final = dict(hf_model.named_parameters()), as_ref(bema.bema_state_dict())
    assert set(final) == set(reloaded)
    for name, value in final.items():
        assert torch.equal(reloaded[name], value), name
    assert torch.equal(hf_model.lm_head.weight, final[emb])  # still tied
    assert not torch.equal(module.model.lm_head.weight, final[emb])  # apply_at_end=False
    assert type(AutoTokenizer.from_pretrained(export)).__name__ == "ByT5Tokenizer"
    # default location: <trainer.log_dir or default_root_dir>/bema, on global rank 0
    stub = SimpleNamespace(
        log_dir=None,
        default_root_dir=str(tmp_path / "root"),
        is_global_zero=True,
        strategy=SimpleNamespace(barrier=lambda name: None),
    )
    bema.export_dir = None
    bema._export(stub, module)
    assert (tmp_path / "root" / "bema" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        ("none", "needs `pl_module.ref_model`"),
        ("shared", "the policy itself or not frozen"),
        ("trainable", "the policy itself or not frozen"),
        ("other", "no parameter matching"),
    ],
)
def test_update_ref_model_needs_a_separate_ref_model(tmp_path, ref, match):
    module = PolicyWithRef(ref=ref)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        make_trainer(tmp_path, 2, [BEMA(update_ref_model=True)]).fit(module)
    assert all(torch.equal(v, before[k]) for k, v in module.model.state_dict().items())  # failed before training


def test_missing_ref_model_attribute(tmp_path):
    with pytest.raises(ValueError, match="LinearSGD.ref_model is NoneType"):
        make_trainer(tmp_path, 2, [BEMA(update_ref_model=True)]).fit(LinearSGD())


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("update_freq", 0),
        ("update_freq", 1.5),
        ("ema_power", -0.1),
        ("bias_power", float("nan")),
        ("lag", -1),
        ("update_after", -1),
        ("multiplier", 0.0),
        ("min_ema_multiplier", 1.5),
        ("ref_model_update_freq", 0),
        ("ref_model_update_after", -3),
        ("evaluate_with_bema", "yes"),
        ("export_dir", ""),
        ("device", "not-a-device"),
    ],
)
def test_invalid_arguments_name_value_and_fix(name, value):
    with pytest.raises(ValueError, match=rf"`BEMA\({name}={value!r}\)` is invalid"):
        BEMA(**{name: value})


def test_refuses_fsdp1_and_early_access():  # FSDP2 (ModelParallelStrategy) is accepted: tests/test_fsdp.py
    with pytest.raises(ValueError, match="does not support FSDPStrategy's sharded parameters.*ModelParallelStrategy"):
        BEMA().setup(SimpleNamespace(strategy=FSDPStrategy()), None, "fit")
    with pytest.raises(RuntimeError, match="after `trainer.fit` has started"):
        BEMA().bema_state_dict()


@pytest.mark.ddp
def test_ddp_two_ranks(ddp_world):
    out = ddp_world.part("bema")  # tests/scripts/ddp_bema.py
    results = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    # the script trains on per-rank data; DDP averages the gradients, so each step subtracts LR * mean over ranks
    config = results[0]["config"]
    steps = results[0]["steps"]
    thetas = [np.array(A0 + [b for row in B0 for b in row], dtype=np.float64)]
    for t in range(steps):
        thetas.append(thetas[-1] - LR * 0.5 * (coefficients(t) + coefficients(t + 100)))
    expected = trl_bema(thetas, **config)
    for r, res in enumerate(results):
        np.testing.assert_allclose(flat(res["bema"]), expected[-1], atol=1e-12, err_msg=f"rank {r}")
        np.testing.assert_allclose(flat(res["resumed_bema"]), expected[-1], atol=1e-12, err_msg=f"rank {r} resumed")
        np.testing.assert_allclose(flat(res["live"]), thetas[-1], atol=1e-12)
        for step, value in res["val"]:  # evaluate_with_bema on every rank
            assert value == pytest.approx(float(VAL_K @ expected[step]), abs=1e-12)
        assert len(res["val"]) > 0
