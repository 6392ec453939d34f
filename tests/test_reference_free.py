"""ORPOModule and CPOModule (CPO, SimPO, AlphaPO): the pure losses on hand-checked values, the loss, gradients and
metrics of TRL 1.16's own experimental ``ORPOTrainer``/``CPOTrainer`` (instantiated on the same in-memory tiny model
and rows, one batch through its ``get_batch_loss_metrics``), token-exact accumulation, padding-free batches, no
reference model, and the recipes.

Tolerances: the module and TRL run the same forward on the same token ids (asserted equal), so their results differ
by float32 rounding of differently ordered reductions only. Each loss/gradient comparison is calibrated on the machine
it runs on (``tests/helpers/rounding.py``): the module's own float32 result against its float64 twin gives the
rounding scale, and the check requires a real mistake (the pair term on summed instead of averaged log-probs, or the
other way round; one pair left out of a step) to be 100 bounds away. Metrics are means of the same values: equal to
``rel=1e-5`` (float32 means of ~4 values of size ~10 differ by a few units of 1e-7 measured).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from datasets import Dataset

from helpers.accumulation import GradCapture, calibrated
from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.data import PreferenceDataModule, builtin
from lit_trainer.losses.reference_free import cpo_loss, cpo_rewards, orpo_log_odds, orpo_loss
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.modules.cpo import CPOModule
from lit_trainer.modules.orpo import ORPOModule

trl_orpo = pytest.importorskip("trl.experimental.orpo")
trl_cpo = pytest.importorskip("trl.experimental.cpo")

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "prompt": ["12+34=", "5+5=", "99+1=", "7+80="],
    "chosen": ["46", "10", "100", "87"],
    "rejected": ["47", "11", "10", "78"],
}
# uneven prompt and completion lengths: micro-batches of one step hold very different token counts
UNEVEN = {
    "prompt": ["1+2=", "100+200=", "5=", "a much longer prompt=", "7+8=", "x=", "12+12=", "what is 3+4="],
    "chosen": ["3", "300", "5", "ok", "15", "a longer chosen answer", "24", "7"],
    "rejected": ["4", "301", "six", "not ok at all", "16", "b", "42", "seven"],
}


# --------------------------------------------------------------------------------------------- the pure losses
def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_losses_on_hand_checked_values():
    c, r = torch.tensor([-0.5, -1.0]), torch.tensor([-2.0, -0.25])
    # ORPO: log odds = log(p/(1-p)) of chosen minus of rejected, loss = -beta log sigma(L)
    odds = [math.log(math.exp(a) / (1 - math.exp(a))) - math.log(math.exp(b) / (1 - math.exp(b))) for a, b in
            zip((-0.5, -1.0), (-2.0, -0.25))]  # fmt: skip
    assert orpo_log_odds(c, r).tolist() == pytest.approx(odds, rel=1e-6)
    assert orpo_loss(c, r, beta=0.2).tolist() == pytest.approx([-0.2 * math.log(_sig(x)) for x in odds], rel=1e-6)
    d = [1.5, -0.75]  # chosen minus rejected
    ls = lambda z, e: -(1 - e) * math.log(_sig(z)) - e * math.log(_sig(-z))
    expect = {
        ("sigmoid", 0.5, 0.1, 0.0): [ls(0.5 * x, 0.1) for x in d],
        ("hinge", 0.5, 0.0, 0.0): [max(0.0, 1 - 0.5 * x) for x in d],
        ("ipo", 0.5, 0.0, 0.0): [(x - 1.0) ** 2 for x in d],
        ("simpo", 2.0, 0.2, 0.0): [ls(2.0 * x - 0.8, 0.2) for x in d],  # gamma 0.8
    }
    for (loss_type, beta, eps, _), values in expect.items():
        got = cpo_loss(c, r, loss_type=loss_type, beta=beta, label_smoothing=eps, simpo_gamma=0.8)
        assert got.tolist() == pytest.approx(values, rel=1e-6), loss_type
    # AlphaPO: r = (1 - p^-a)/a with p = e^logp, then the simpo loss on the reward difference
    alpha = 0.25
    reward = lambda lp: (1 - math.exp(lp) ** -alpha) / alpha
    rd = [reward(a) - reward(b) for a, b in zip((-0.5, -1.0), (-2.0, -0.25))]
    got = cpo_loss(c, r, loss_type="alphapo", beta=2.0, simpo_gamma=0.8, alpha=alpha)
    assert got.tolist() == pytest.approx([ls(2.0 * x - 0.8, 0.0) for x in rd], rel=1e-6)
    # where e^logp underflows, TRL's p.pow(-alpha) is inf; the expm1 form is finite
    assert torch.isfinite(cpo_rewards(torch.tensor([-200.0]), alpha=0.25)).all()


def test_orpo_log_odds_keep_finite_gradients_where_trl_gives_nan():
    # a confident float32 model rounds a chosen completion's mean log-prob to exactly 0: TRL's log1mexp gives
    # log(0) and a NaN gradient through torch.where; ours caps the log-prob just below 0
    x = torch.tensor([0.0, -0.3, -3.0], requires_grad=True)
    trl_orpo.orpo_trainer.log1mexp(x).sum().backward()
    assert torch.isnan(x.grad[0])
    ours = torch.tensor([0.0, -0.3, -3.0], requires_grad=True)
    loss = orpo_loss(ours, torch.tensor([-1.0, -1.0, -1.0]))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(ours.grad).all()
    # away from 0 both branches of log(1 - e^x) agree with TRL's
    y = torch.tensor([-5.0, -0.7, -0.69, -1e-3])
    pr = torch.full_like(y, -1.0)
    assert orpo_log_odds(y, pr).tolist() == pytest.approx(
        ((y - pr) - (trl_orpo.orpo_trainer.log1mexp(y) - trl_orpo.orpo_trainer.log1mexp(pr))).tolist(), rel=1e-6
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "kto_pair"}, "loss_type='kto_pair'"),
        ({"beta": 0.0}, "beta=0.0"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, "does nothing with loss_type='hinge'"),
        ({"label_smoothing": 1.0}, r"\[0, 1\)"),
        ({"loss_type": "alphapo"}, "alpha=0.0 is plain SimPO"),
        ({"cpo_alpha": -1.0}, "cpo_alpha=-1.0"),
    ],
)
def test_invalid_cpo_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPOModule(tiny_llama(0), **kwargs)


def test_invalid_orpo_beta_is_rejected():
    with pytest.raises(ValueError, match=r"ORPOModule\(beta=-1"):
        ORPOModule(tiny_llama(0), beta=-1.0)


# ----------------------------------------------------------------------------------------- against TRL 1.16
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny"), load_tokenizer("tiny")


def _trl(model, tokenizer, options: dict, tmp_path):
    common = {"output_dir": str(tmp_path / "trl"), "report_to": "none", "use_cpu": True, "bf16": False}
    common.update(gradient_checkpointing=False, max_length=64)
    if options.get("module") == "orpo":
        args = trl_orpo.ORPOConfig(**common, beta=options["beta"])
        cls = trl_orpo.ORPOTrainer
    else:
        trl_options = {k: v for k, v in options.items() if k != "module"}
        args, cls = trl_cpo.CPOConfig(**common, **trl_options), trl_cpo.CPOTrainer
    return cls(model=model, args=args, train_dataset=Dataset.from_dict(ROWS), processing_class=tokenizer)


def _module(model, options: dict):
    options = dict(options)
    if options.pop("module", None) == "orpo":
        return ORPOModule(model, **options)
    return CPOModule(model, **options)


def _batch(tokenizer, rows: dict, **kw) -> tuple[PreferenceDataModule, dict[str, torch.Tensor]]:
    """The data module and ALL its pairs as one training batch (packed with ``packing="padding_free"``)."""
    kw = {"val_size": 0, "batch_size": len(rows["prompt"]), "max_length": 64, "sampling": "sequential", **kw}
    dm = PreferenceDataModule(tokenizer=tokenizer, dataset=Dataset.from_dict(rows), **kw)
    dm.setup("fit")
    return dm, dm._collate([dm.train_dataset[i] for i in range(len(dm.train_dataset))], True)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _ours(model, options, batch, dtype=torch.float32, toggle_average=False):
    module = _module(copy.deepcopy(model).to(dtype), options)
    if toggle_average:  # the mistake: the pair term on the other reduction of the log-probs
        module.averaged = not module.averaged
    loss, metrics = module.compute_loss(batch, None)
    loss.backward()
    return loss.detach(), _grads(module.model), metrics


CASES = {
    "orpo": {"module": "orpo", "beta": 0.25},
    "cpo_sigmoid_smoothed": {"loss_type": "sigmoid", "beta": 0.5, "label_smoothing": 0.1, "cpo_alpha": 1.0},
    "cpo_hinge": {"loss_type": "hinge", "beta": 0.5, "cpo_alpha": 0.5},
    "cpo_ipo": {"loss_type": "ipo", "beta": 0.5, "cpo_alpha": 1.0},
    "simpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0, "label_smoothing": 0.1, "cpo_alpha": 0.0},
    "cpo_simpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.3},
    "alphapo": {"loss_type": "alphapo", "beta": 2.0, "simpo_gamma": 0.5, "alpha": 0.25},
    "cpo_sigmoid_alpha": {"loss_type": "sigmoid", "beta": 0.1, "alpha": 0.05, "cpo_alpha": 1.0},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_gradients_and_metrics_match_trl(case, tiny, tmp_path):
    model, tokenizer = tiny
    options = CASES[case]
    trainer = _trl(copy.deepcopy(model), tokenizer, options, tmp_path)
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    trainer.model.train()
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(trainer.model, trl_batch)
    trl_loss.backward()
    trl_grads = _grads(trainer.model)

    _, batch = _batch(tokenizer, ROWS)
    pairs = len(ROWS["prompt"])
    assert torch.equal(batch["input_ids"][:pairs], trl_batch["chosen_input_ids"])  # the same token ids
    assert torch.equal(batch["input_ids"][pairs:], trl_batch["rejected_input_ids"])
    loss, grads, metrics = _ours(model, options, batch)
    loss64, grads64, _ = _ours(model, options, batch, torch.float64)
    wrong_loss, wrong_grads, _ = _ours(model, options, batch, toggle_average=True)

    value = lambda x: {"loss": x.reshape(1)}
    Rounding.of(value(loss), value(loss64), what="loss").check(
        value(loss), value(trl_loss.detach()), mistake=relative_l2(value(wrong_loss), value(loss))
    )
    Rounding.of(grads, grads64, what="gradient").check(grads, trl_grads, mistake=relative_l2(wrong_grads, grads))
    assert grads.keys() == trl_grads.keys()

    compared = [k for k in trl_metrics if not k.startswith("logits/")]  # TRL's logits means include padding
    if not options.get("cpo_alpha", 1.0) or options.get("loss_type") == "alphapo":
        compared.remove("nll_loss")  # TRL logs 0 when it skips the NLL; we log its value
    for name in compared:
        assert float(metrics[name]) == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    assert set(metrics) >= set(trl_metrics)


# ------------------------------------------------------------------------------------- accumulation, packing
def _trainer(steps: int, callbacks=(), **kw):
    import lightning.pytorch as pl

    kw = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "num_sanity_val_steps": 0,
          "enable_model_summary": False, "accelerator": "cpu", "devices": 1, **kw}  # fmt: skip
    return pl.Trainer(max_steps=steps, callbacks=list(callbacks), **kw)


def _full_batch_gradient(options: dict, batch: dict, pairs: int):
    """The gradient of the module's own one-micro-batch loss (TRL's, per the test above) on the first ``pairs``
    pairs of ``batch`` (8 pairs: chosen rows 0..7, rejected 8..15), as a function of the policy."""
    keep = list(range(pairs)) + list(range(8, 8 + pairs))
    part = {k: v[keep] for k, v in batch.items()}

    def gradient(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        module = _module(policy, options)
        module.compute_loss(part, None)[0].backward()
        return {n: p.grad.clone() for n, p in module.model.named_parameters()}

    return gradient


@pytest.mark.parametrize("case", ["orpo", "cpo_sigmoid_smoothed"])
def test_accumulation_of_two_micro_batches_equals_the_full_batch(case, tokenizer):
    """8 pairs of very uneven lengths as 2 micro-batches of 4: the pair term is a mean over the step's 8 pairs and
    the NLL a mean over all its chosen tokens (ORPO: prompt included), as one full batch of 8 gives."""
    options = CASES[case]
    dm, batch = _batch(tokenizer, UNEVEN, batch_size=4)
    chosen = batch["attention_mask"][:8].sum(-1)
    assert int(chosen[:4].sum()) != int(chosen[4:].sum())  # the two micro-batches hold different token counts
    full = calibrated(
        _full_batch_gradient(options, batch, 8),
        tiny_llama(0),
        mistake=_full_batch_gradient(options, batch, 7),
        what=f"{case} full batch",
    )
    capture = GradCapture()
    _trainer(1, [capture], accumulate_grad_batches=2).fit(_module(tiny_llama(0), options), datamodule=dm)
    full.check(capture.grads[0])


def test_padding_free_batches_give_the_padded_loss(tokenizer):
    """ORPO's NLL over the prompt too on a packed row: each row's first token is not a target of the row before."""
    _, padded = _batch(tokenizer, UNEVEN)
    _, packed = _batch(tokenizer, UNEVEN, packing="padding_free")
    assert "seq_lengths" in packed
    options = CASES["orpo"]
    reference = calibrated(
        _full_batch_gradient(options, padded, 8),
        tiny_llama(0),
        mistake=_full_batch_gradient(options, padded, 7),
        what="padded ORPO",
    )
    module = _module(tiny_llama(0), options)
    module.compute_loss(packed, None)[0].backward()
    reference.check({n: p.grad for n, p in module.model.named_parameters()})


def test_orpo_counts_prompt_tokens_and_cpo_completion_tokens(tokenizer):
    dm, batch = _batch(tokenizer, UNEVEN)
    counts = dm.count_items(batch)
    completion = batch["completion_mask"][:8, 1:].sum()
    sequence = batch["attention_mask"][:8, 1:].sum()
    assert counts.tolist() == [8, int(completion), int(sequence)] and sequence > completion
    module = ORPOModule(tiny_llama(0))
    with pytest.raises(ValueError, match="needs 3 counts"):
        module.compute_loss(batch, torch.tensor([8.0, float(completion)]))


def test_no_reference_model_is_created():
    policy = tiny_llama(0)
    size = sum(p.numel() for p in policy.parameters())
    for module in (ORPOModule(policy), CPOModule(tiny_llama(0), loss_type="simpo", cpo_alpha=0.0)):
        assert module.ref_model is None
        assert sum(p.numel() for p in module.parameters()) == size  # the policy only: no copy
        models = [m for m in module.modules() if m.__class__.__name__.endswith("ForCausalLM")]
        assert len(models) == 1 and module.networks_to_shard() == [module.model]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["orpo.yaml", "simpo.yaml"])
def test_recipe_configs_run_a_few_steps(config, tmp_path, monkeypatch):
    loaded = yaml.safe_load((ROOT / "configs" / config).read_text())
    assert loaded["data"]["init_args"]["dataset"] == "builtin:addition"
    data = tmp_path / "pairs.jsonl"  # 40 of the built-in pairs: the full set takes seconds to tokenize
    data.write_text("\n".join(json.dumps(r) for r in builtin.preference_rows("train").select(range(40)).to_list()))
    monkeypatch.chdir(tmp_path)
    options = {"--model.init_args.model": "tiny-64", "--data.init_args.dataset": str(data), "--trainer.max_steps": "3"}
    options |= {"--trainer.log_every_n_steps": "1", "--trainer.enable_progress_bar": "false"}
    options |= {"--data.init_args.batch_size": "8", "--data.init_args.eval_batch_size": "8"}
    options |= {"--trainer.limit_val_batches": "1", "--trainer.val_check_interval": "3"}
    cli = LitTrainerCLI(args=["fit", "--config", str(ROOT / "configs" / config), *sum(options.items(), ())])
    assert cli.trainer.global_step == 3
    expected = {"orpo.yaml": ORPOModule, "simpo.yaml": CPOModule}[config]
    assert type(cli.model) is expected
    logged = cli.trainer.callback_metrics
    names = ("rewards/accuracies", "rewards/margins", "nll_loss", "val_loss", "val_rewards/accuracies")
    assert all(torch.isfinite(logged[name]) for name in names)
    if config == "orpo.yaml":
        assert "log_odds_ratio" in logged and "val_log_odds_chosen" in logged
    else:
        assert cli.model.loss_type == "simpo" and cli.model.nll_weight == loaded["model"]["init_args"]["cpo_alpha"]


def test_a_short_fit_raises_the_chosen_margin(tokenizer):
    """4 steps on the same 8 pairs at a high learning rate: SimPO's reward margin and ORPO's log odds rise."""
    for options, key in ((CASES["simpo"], "rewards/margins"), (CASES["orpo"], "log_odds_chosen")):
        dm, batch = _batch(tokenizer, UNEVEN, batch_size=8)
        module = _module(tiny_llama(0), {**options, "learning_rate": 3e-3, "scheduler": "constant"})
        before = module.compute_loss(batch, None)[1][key]
        _trainer(4).fit(module, datamodule=dm)
        module.eval()
        with torch.no_grad():
            after = module.compute_loss(batch, None)[1][key]
        assert after > before + 0.1, (key, float(before), float(after))


def test_logged_rewards_are_beta_times_the_reward():
    c, r = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    module = CPOModule(tiny_llama(0), loss_type="sigmoid", beta=0.5, alpha=0.1)
    metrics = module.pair_metrics(c, r)
    rc, rr = 0.5 * cpo_rewards(c, 0.1), 0.5 * cpo_rewards(r, 0.1)
    assert float(metrics["rewards/margins"]) == pytest.approx(float((rc - rr).mean()))
    assert float(metrics["rewards/accuracies"]) == 0.5
    orpo = ORPOModule(tiny_llama(0), beta=0.2).pair_metrics(c, r)
    assert float(orpo["log_odds_ratio"]) == pytest.approx(float(F.logsigmoid(orpo_log_odds(c, r)).mean()))
    assert float(orpo["rewards/chosen"]) == pytest.approx(-0.3)


# ------------------------------------------------------------------------------- chunked logits, LoRA, resume
@pytest.mark.parametrize("case", ["orpo", "cpo_simpo"])
def test_chunked_logits_give_the_full_logits_gradient(case, tokenizer):
    """The per-token log-probabilities a chunk of 5 positions at a time (``chunked_logits="on"``) give the gradient
    of the full logits, within the float32 rounding of another summation order (calibrated in float64)."""
    _, batch = _batch(tokenizer, UNEVEN)

    def gradient(chunked: str, pairs: int = 8):
        keep = list(range(pairs)) + list(range(8, 8 + pairs))
        part = {k: v[keep] for k, v in batch.items()}

        def of(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
            module = _module(policy, {**CASES[case], "chunked_logits": chunked, "logits_chunk_size": 5})
            module.compute_loss(part, None)[0].backward()
            return {n: p.grad.clone() for n, p in module.model.named_parameters()}

        return of

    full = calibrated(gradient("off"), tiny_llama(0), mistake=gradient("off", pairs=7), what=f"{case} full logits")
    full.check(gradient("on")(tiny_llama(0)))


def test_lora_orpo_trains_only_the_adapters_and_resumes_exactly(tokenizer, tmp_path):
    """ORPO on a LoRA policy: 4 steps change only the adapters; resumed from the step-2 checkpoint (adapter-only, as
    every module's LoRA checkpoint) the run ends with the uninterrupted run's adapters, bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_trainer.callbacks import ExactResume

    def fit(folder: Path, ckpt_path: str | None = None) -> ORPOModule:
        dm, _ = _batch(tokenizer, UNEVEN, batch_size=2, sampling="random", seed=3)
        options = {"beta": 0.25, "learning_rate": 3e-3, "peft_config": {"r": 4, "target_modules": "all-linear"}}
        module = ORPOModule(tiny_llama(0), **options)
        saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        trainer = _trainer(4, [saver, ExactResume()], enable_checkpointing=True, default_root_dir=folder)
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module

    straight = fit(tmp_path / "a")
    start = tiny_llama(0).state_dict()
    for name, value in straight.model.named_parameters():
        if "lora_" not in name:  # the base never moves
            assert torch.equal(value, start[name.replace("base_model.model.", "").replace(".base_layer", "")]), name
    adapters = {n: p for n, p in straight.model.named_parameters() if "lora_" in n}
    assert adapters and any(float(p.abs().sum()) > 0 for n, p in adapters.items() if "lora_B" in n)
    resumed = fit(tmp_path / "b", ckpt_path=str(tmp_path / "a" / "step=2.ckpt"))
    for name, value in resumed.model.named_parameters():
        assert torch.equal(value, dict(straight.model.named_parameters())[name]), name
