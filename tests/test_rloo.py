"""RLOOModule and the RLOO losses against TRL 1.16's ``RLOOTrainer``: advantages (leave-one-out baseline, KL reward
penalty, reward clipping, weights, whitening, unscored rows), the sequence-level clipped loss and its gradient, on
fixed tensors and on a tiny model with scripted completions; plus hand-checked baselines and a short config fit.

TRL runs its own code: ``RLOOTrainer._generate_and_score_completions`` / ``_compute_loss`` on a stand-in object for
the fixed tensors (generation, rewards and the model forward replaced by the given tensors), and a real
``RLOOTrainer`` on the tiny model with the same scripted completions as ours.
"""

from __future__ import annotations

import copy
import logging
import os
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from datasets import Dataset

from helpers.rounding import Rounding, relative_l2
from helpers.tool_policy import ScriptedGenerate
from lit_trainer.data import PromptDataModule
from lit_trainer.losses.rloo import rloo_advantages, rloo_loss_metrics, rloo_policy_loss, sequence_logps
from lit_trainer.models import build_preset_model, build_tokenizer
from lit_trainer.modules.rloo import RLOOModule
from lit_trainer.rewards import arithmetic_reward

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
CONFIG = Path(__file__).parents[1] / "configs" / "rloo.yaml"
QUIET = {
    "accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
    "enable_checkpointing": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
}  # fmt: skip


# ------------------------------------------------------------------------------------------ hand-checked values
def test_leave_one_out_baseline_hand_values():
    # one group of 4: baselines (0+0+1)/3, (1+0+1)/3, ...: advantages +-2/3
    got = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    torch.testing.assert_close(got, torch.tensor([2, -2, -2, 2]) / 3.0)  # float32 of x/3: default rtol 1.3e-6
    # two groups of 2: each row minus its sibling; equal rewards -> 0
    assert rloo_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2).tolist() == [1.0, -1.0, 0.0, 0.0]
    # an unscored row (NaN) is left out of its siblings' baselines and gets 0: 1 - (0+0)/2, 0 - (1+0)/2
    assert rloo_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), 4).tolist() == [1.0, 0.0, -0.5, -0.5]
    # two functions, weights (1, 0.5), NaN = that function did not score: r = [1.5, 0, 0.5, 2]
    rewards = torch.tensor([[1.0, 1.0], [0.0, float("nan")], [0.0, 1.0], [1.0, 2.0]])
    expected = torch.tensor([1.5 - 2.5 / 3, 0 - 4 / 3, 0.5 - 3.5 / 3, 2 - 2 / 3])
    torch.testing.assert_close(rloo_advantages(rewards, 4, reward_weights=[1.0, 0.5]), expected)
    # clipping applies to the weighted reward, then the KL penalty r - beta * KL
    clipped = rloo_advantages(torch.tensor([2.0, -3.0]), 2, reward_clip_range=(-1.0, 1.0))
    assert clipped.tolist() == [2.0, -2.0]
    kl = rloo_advantages(torch.tensor([1.0, 0.0]), 2, kl=torch.tensor([2.0, 0.0]), beta=0.5)
    assert kl.tolist() == [0.0, 0.0]  # 1 - 0.5 * 2 = 0 against 0
    # whitening over the batch: mean 0, std 1 up to the 1e-4 in the denominator
    white = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 1.0]), 2, normalize_advantages=True)
    assert abs(float(white.mean())) < 1e-6 and float(white.std()) == pytest.approx(1.0, abs=1e-3)


def test_bad_options_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="num_generations=1"):
        rloo_advantages(torch.ones(2), 1)
    with pytest.raises(ValueError, match="reward_clip_range"):
        rloo_advantages(torch.ones(2), 2, reward_clip_range=(1.0, -1.0))
    with pytest.raises(ValueError, match="needs `kl`"):
        rloo_advantages(torch.ones(2), 2, beta=0.1)
    with pytest.raises(TypeError, match="scale_rewards"):  # GRPOModule's option, not RLOOModule's
        RLOOModule("tiny", reward_funcs=[arithmetic_reward], scale_rewards="batch")
    with pytest.raises(ValueError, match="reward_clip_range"):
        RLOOModule("tiny", reward_funcs=[arithmetic_reward], reward_clip_range=(2.0, 1.0))


# ---------------------------------------------------------------------------- TRL on fixed tensors (stand-in)
class OneProcess:
    """What ``_generate_and_score_completions`` / ``_compute_loss`` ask of the accelerator, for one process."""

    process_index, num_processes, device = 0, 1, torch.device("cpu")

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def stand_in(**attributes: Any) -> Any:
    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
        accelerator=OneProcess(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        aux_loss_enabled=False,
        **attributes,
    )
    return fake


def trl_advantages(monkeypatch, rewards, lengths, truncated, old, ref, options) -> tuple[torch.Tensor, dict]:
    """TRL's ``_generate_and_score_completions`` with its generation, reward calls and forward replaced by the given
    per-function rewards, completions (``lengths``, ending in EOS unless ``truncated``) and per-token log-probs."""
    from trl.trainer import rloo_trainer

    monkeypatch.setattr(rloo_trainer, "gather", lambda t: t)
    monkeypatch.setattr(rloo_trainer, "gather_object", lambda o: o)
    ids = [[7] * (n - 1) + ([9] if cut else [1]) for n, cut in zip(lengths, truncated)]
    fake = stand_in(
        ref_model=object(), mask_truncated_completions=options["mask_truncated_completions"], eos_token_ids=[1],
        _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
        args=types.SimpleNamespace(per_device_train_batch_size=len(ids), gradient_checkpointing_kwargs=None),
        beta=options["beta"], num_generations=options["num_generations"],
        reward_clip_range=options["reward_clip_range"],
        reward_weights=torch.tensor(options["reward_weights"]), normalize_advantages=options["normalize_advantages"],
        reward_func_names=[f"f{k}" for k in range(rewards.shape[1])], log_multimodal=False,
        _logs={"prompt": [], "completion": [], "advantages": [], "rewards": defaultdict(list),
               "extra": defaultdict(list), "images": []},
        _pending_extra_logs=defaultdict(list), _pending_metrics=defaultdict(list),
    )  # fmt: skip
    fake._generate = lambda prompts: ([[3, 4]] * len(ids), ids, ["x"] * len(ids))
    fake._calculate_rewards = lambda *args: rewards.clone()
    fake._get_per_token_logps_and_entropies = lambda model, *a, **k: (old if model is fake.model else ref, None, None)
    out = rloo_trainer.RLOOTrainer._generate_and_score_completions(fake, [{"prompt": "p"}] * len(ids))
    return out, {k: v[0] for k, v in fake._metrics["train"].items()}


FIXED_OPTIONS = [
    {"beta": 0.0, "normalize_advantages": False, "reward_clip_range": None, "mask_truncated_completions": False},
    {"beta": 0.3, "normalize_advantages": False, "reward_clip_range": None, "mask_truncated_completions": False},
    {"beta": 0.3, "normalize_advantages": True, "reward_clip_range": (-0.5, 0.8), "mask_truncated_completions": True},
    {"beta": 0.0, "normalize_advantages": True, "reward_clip_range": (0.0, 1.0), "mask_truncated_completions": False},
]


@pytest.mark.parametrize("options", FIXED_OPTIONS, ids=lambda o: f"beta{o['beta']}-norm{o['normalize_advantages']}")
def test_advantages_and_metrics_equal_trl_on_fixed_tensors(monkeypatch, options):
    g = torch.Generator().manual_seed(0)
    n, g_size, c = 12, 4, 5
    rewards = torch.rand(n, 2, generator=g) * 2 - 0.5
    rewards[1, 1] = rewards[6, 0] = float("nan")  # one function did not score these rows
    rewards[9] = float("nan")  # no function scored this row: advantage 0, out of its siblings' baseline
    lengths = torch.randint(1, c + 1, (n,), generator=g).tolist()
    lengths[0] = c  # the padded width is c
    truncated = [k % 5 == 2 for k in range(n)]
    old, ref = torch.randn(n, c, generator=g) - 2, torch.randn(n, c, generator=g) - 2
    options = {**options, "num_generations": g_size, "reward_weights": [1.0, 0.5]}
    out, metrics = trl_advantages(monkeypatch, rewards, lengths, truncated, old, ref, options)

    mask = (torch.arange(c) < torch.tensor(lengths).unsqueeze(1)).long()
    if options["mask_truncated_completions"]:
        mask = mask * (~torch.tensor(truncated)).long().unsqueeze(1)
    assert torch.equal(out["completion_mask"], mask)  # the same rows as ours
    kl = sequence_logps(old - ref, mask)
    ours = rloo_advantages(
        rewards, g_size, reward_weights=options["reward_weights"], reward_clip_range=options["reward_clip_range"],
        kl=kl, beta=options["beta"], normalize_advantages=options["normalize_advantages"],
    )  # fmt: skip
    # float32, the same operations in another order (nansum of the group minus the row vs TRL's (sum - r)): measured
    # up to 2.4e-7 absolute on these values (|A| <= ~5); bound 1e-5. A real mistake (the KL after the baseline, the
    # whole group in the baseline) moves them by > 0.1.
    torch.testing.assert_close(ours, out["advantages"], rtol=0, atol=1e-5)
    assert float(out["advantages"][9]) == 0.0 and ours.abs().sum() > 1
    torch.testing.assert_close(sequence_logps(old, mask), out["old_logps"], rtol=0, atol=1e-5)  # same sums, in float32
    if options["beta"]:
        expected_kl = float(((old - ref) * mask).sum() / mask.sum())
        assert metrics["kl"] == pytest.approx(expected_kl, rel=1e-5)  # float32 sums in another order


@pytest.mark.parametrize(("epsilon", "epsilon_high"), [(0.2, None), (0.1, 0.3)])
def test_loss_gradient_and_clip_metrics_equal_trl_on_fixed_tensors(epsilon, epsilon_high):
    from trl import RLOOTrainer

    g = torch.Generator().manual_seed(1)
    n, c = 10, 4
    mask = (torch.arange(c) < torch.randint(1, c + 1, (n, 1), generator=g)).long()
    mask[3] = 0  # a masked truncated completion: ratio 1, no gradient, still counted in the mean
    base = torch.randn(n, c, generator=g) - 1.5
    old = base + 0.15 * torch.randn(n, c, generator=g)  # sequence ratios from ~0.5 to ~2: both clips are hit
    advantages = torch.randn(n, generator=g)
    entropies = torch.rand(n, c, generator=g)

    theirs_logps = base.clone().requires_grad_(True)
    fake = stand_in(epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (theirs_logps, entropies, None)
    inputs = {
        "prompt_ids": torch.ones(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.ones(n, c, dtype=torch.long), "completion_mask": mask,
        "old_logps": (old * mask).sum(1), "advantages": advantages,
    }  # fmt: skip
    theirs = RLOOTrainer._compute_loss(fake, fake.model, inputs)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logps)

    ours_logps = base.clone().requires_grad_(True)
    clip = {"epsilon": epsilon, "epsilon_high": epsilon_high}
    ours = rloo_policy_loss(ours_logps, old, advantages, mask, **clip)
    (ours_grad,) = torch.autograd.grad(ours, ours_logps)
    # float32 sums of the same terms: measured 0 to 6e-8 apart; bound 1e-6 (the loss is ~0.5, gradients ~0.1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=0, atol=1e-6)
    assert ours_grad[3].abs().sum() == 0 and ours_grad.abs().sum() > 0.1
    metrics = rloo_loss_metrics(ours_logps, old, advantages, mask, **clip)
    for key, value in metrics.items():
        assert float(value) == fake._metrics["train"][key][0], key  # fractions of 10 rows: exact
    assert 0 < float(metrics["clip_ratio/region_mean"]) < 1  # some rows clipped, some not


# ------------------------------------------------------------------- TRL on a tiny model, scripted completions
PROBLEMS = [(12, 34), (50, 27), (61, 18)]  # equal-length prompts: no left padding (TRL passes no position ids)
G = 4
MAX_COMPLETION = 4


def reply(context: str, occurrence: int) -> str:
    """Per generation of a prompt: right, wrong, right but truncated (no EOS in 4 tokens), wrong and long-ish."""
    a, b = (int(x) for x in context.split("=")[0].split("+"))
    return [f"{a + b}</s>", f"{a + b + 1}</s>", f"{a + b}999", f"{a - b}</s>"][occurrence % G]


def length_bonus(prompts: list, completions: list, completion_ids: list, **_: Any) -> list[float | None]:
    """A second reward function: 0.1 per completion token, None (unscored) for completions starting with '9'."""
    return [None if str(c).startswith("9") else 0.1 * len(ids) for c, ids in zip(completions, completion_ids)]


def prompt_rows() -> Dataset:
    return Dataset.from_dict(
        {"prompt": [f"{a}+{b}=" for a, b in PROBLEMS], "answer": [str(a + b) for a, b in PROBLEMS]}
    )


def initial_model(path: Path) -> Any:
    torch.manual_seed(0)
    model = build_preset_model("tiny-64")
    model.save_pretrained(path)
    return model


def perturb(model: Any) -> Any:
    """Move the policy away from the reference (so the KL is not 0), the same way on both sides."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


SCRIPTED_OPTIONS = [
    {"beta": 0.2, "reward_weights": [1.0, 0.5], "reward_clip_range": (0.0, 1.2), "normalize_advantages": False,
     "mask_truncated_completions": True},
    {"beta": 0.0, "reward_weights": [2.0, 1.0], "reward_clip_range": None, "normalize_advantages": True,
     "mask_truncated_completions": False},
]  # fmt: skip


@pytest.fixture(scope="module")
def trl_side(tmp_path_factory):
    """One real ``RLOOTrainer`` (beta != 0, so it loads a reference from the saved initial weights) on a perturbed
    policy; the options are set per test on the instance (what ``__init__`` stores them as)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig, RLOOTrainer

    tmp = tmp_path_factory.mktemp("rloo_trl")
    initial_model(tmp / "initial")
    policy = perturb(AutoModelForCausalLM.from_pretrained(tmp / "initial"))
    args = RLOOConfig(
        output_dir=str(tmp / "out"), report_to="none", per_device_train_batch_size=len(PROBLEMS) * G,
        num_generations=G, use_cpu=True, bf16=False, max_completion_length=MAX_COMPLETION, beta=0.2,
    )  # fmt: skip
    trainer = RLOOTrainer(
        model=policy, reward_funcs=[arithmetic_reward, length_bonus], args=args, train_dataset=prompt_rows(),
        processing_class=build_tokenizer(),
    )  # fmt: skip
    ScriptedGenerate(trainer.model, build_tokenizer(), reply)
    return trainer, policy, tmp / "initial"


def trl_step(trainer: Any, policy: Any, options: dict) -> dict:
    trainer.beta, trainer.normalize_advantages = options["beta"], options["normalize_advantages"]
    trainer.reward_clip_range = options["reward_clip_range"]
    trainer.mask_truncated_completions = options["mask_truncated_completions"]
    trainer.reward_weights = torch.tensor(options["reward_weights"])
    rows = prompt_rows()
    inputs = [{"prompt": p, "answer": a} for p, a in zip(rows["prompt"], rows["answer"]) for _ in range(G)]
    out = trainer._generate_and_score_completions(inputs)
    result = {"out": out}
    for dtype in (torch.float32, torch.float64):
        model = copy.deepcopy(policy).to(dtype)
        loss = trainer.compute_loss(model, out)
        loss.backward()
        result[dtype] = (loss.detach(), {n: p.grad.detach().float() for n, p in model.named_parameters()})
    return result


class FirstSteps(L.Callback):
    """Per optimizer step: the loss of its last micro-step, the gradients, the buffered slices and the weights the
    gradient was taken at."""

    def __init__(self) -> None:
        self.losses, self.grads, self.slices, self.weights = [], [], [], []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach())

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()})
        self.slices.append([dict(s) for s in pl_module._buffer.slices])
        self.weights.append(copy.deepcopy(pl_module.model.state_dict()))


def our_steps(path: Path, options: dict, steps: int = 1, batch_size: int = len(PROBLEMS) * G) -> FirstSteps:
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    module = RLOOModule(
        AutoModelForCausalLM.from_pretrained(path), tokenizer=tokenizer, reward_funcs=[arithmetic_reward, length_bonus],
        num_generations=G, max_completion_length=MAX_COMPLETION, learning_rate=1e-3, max_grad_norm=0.0,
        scheduler="constant", generation_seed=0, **options,
    )  # fmt: skip
    perturb(module.model)  # after the reference copy was taken: the reference stays the initial weights
    ScriptedGenerate(module.model, tokenizer, reply)
    data = PromptDataModule(
        tokenizer=tokenizer, dataset=prompt_rows(), batch_size=batch_size, max_length=16, val_size=0,
        sampling="sequential",
    )  # fmt: skip
    record = FirstSteps()
    L.Trainer(max_steps=steps, callbacks=[record], **QUIET).fit(module, datamodule=data)
    return record


def by_sequence(rows: dict[str, torch.Tensor]) -> dict[tuple, tuple]:
    """``{prompt + completion ids: (loss mask, advantage)}``."""
    out = {}
    for i in range(rows["prompt_ids"].shape[0]):
        prompt = rows["prompt_ids"][i][rows["prompt_mask"][i].bool()].tolist()
        completion = [t for t in rows["completion_ids"][i].tolist() if t != 0]
        out[tuple(prompt + completion)] = (int(rows["completion_mask"][i].sum()), float(rows["advantages"][i]))
    return out


@pytest.mark.slow  # building TRL's trainer takes a few seconds
@pytest.mark.parametrize("options", SCRIPTED_OPTIONS, ids=["beta-weights-clip-masked", "no-kl-normalized"])
def test_one_step_equals_trl_on_a_tiny_model(trl_side, options):
    trainer, policy, path = trl_side
    expected = trl_step(trainer, policy, options)
    got = our_steps(path, options)
    theirs, mine = by_sequence(expected["out"]), by_sequence(got.slices[0][0])
    assert len(theirs) == len(PROBLEMS) * G and mine.keys() == theirs.keys()  # the same completions
    for key, (tokens, advantage) in theirs.items():
        assert mine[key][0] == tokens  # the loss mask (truncated rows masked with mask_truncated_completions)
        # float32 rewards/KL/baselines; the KL sums come from separate forwards of the same rows: measured <= 3e-7
        assert mine[key][1] == pytest.approx(advantage, abs=2e-5), key
    assert len({round(a, 4) for _, a in theirs.values()}) > 3  # the advantages are not all alike

    (loss32, grads32), (loss64, grads64) = expected[torch.float32], expected[torch.float64]
    gradient = Rounding.of(grads32, grads64, what="gradient")  # TRL's own float32 rounding of this gradient
    observed = relative_l2(got.grads[0], grads32)
    wrong = {**expected["out"], "advantages": -expected["out"]["advantages"]}  # a real mistake: the sign
    model = copy.deepcopy(policy)
    trainer.compute_loss(model, wrong).backward()
    mistake = relative_l2({n: p.grad for n, p in model.named_parameters()}, grads32)
    assert observed <= gradient.bound, f"gradient differs by {observed:.2e} > {gradient.bound:.2e}"
    assert gradient.bound * 100 <= mistake
    print(f"gradient: observed {observed:.2e}, bound {gradient.bound:.2e}, mistake {mistake:.2e}")
    # the loss is ~0 (leave-one-out advantages sum to 0 in a group and every ratio is 1), so only an absolute check
    # means anything: float32 sums of 12 terms of size <= ~2 differ by ~1e-7; bound 1e-6
    assert abs(float(got.losses[0]) - float(loss32)) <= 1e-6 and abs(float(loss32) - float(loss64)) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "batch_size"),
    [({"num_iterations": 2, "beta": 0.2}, len(PROBLEMS) * G), ({"steps_per_generation": 2, "beta": 0.0}, 6)],
    ids=["num_iterations-2", "steps_per_generation-2"],
)
def test_off_policy_second_step_equals_trl(trl_side, options, batch_size):
    """Step 2 trains on rows generated before step 1 (a second pass, or the round's second slice): its ratio uses the
    stored generation-time log-probs. TRL's ``compute_loss`` on the same rows, weights and old log-probs."""
    trainer, policy, path = trl_side
    got = our_steps(path, options, steps=2, batch_size=batch_size)
    rows = got.slices[1][0 if "num_iterations" in options else 1]
    assert "old_logps" in rows and "ref_logps" not in rows  # the KL is in the advantages, not in the loss
    model = copy.deepcopy(policy)
    model.load_state_dict(got.weights[1])  # the weights after step 1
    inputs = {k: rows[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs["old_logps"] = sequence_logps(rows["old_logps"], rows["completion_mask"])
    theirs = trainer.compute_loss(model, inputs)
    theirs.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    initial = copy.deepcopy(policy)
    initial.load_state_dict(got.weights[0])
    trainer.compute_loss(initial, inputs).backward()  # the mistake: the gradient at the old weights (ratio 1)
    mistake = relative_l2({n: p.grad for n, p in initial.named_parameters()}, grads)
    observed = relative_l2(got.grads[1], grads)
    # float32 vs float32 in another order (separate forwards, ours trimmed to the slice): measured ~1e-6 here; the
    # calibrated bound of the on-policy test above is ~1e-5, so 1e-4 with the mistake >= 100x that
    assert observed < 1e-4 <= mistake / 100, (observed, mistake)
    assert float(theirs.detach()) == pytest.approx(float(got.losses[1]), abs=1e-5)


# ------------------------------------------------------------------------------------------------ config fit
@pytest.mark.slow
def test_rloo_config_parses_and_runs_a_few_steps(tmp_path, monkeypatch):
    from lit_trainer.cli import LitTrainerCLI

    monkeypatch.chdir(tmp_path)
    cli = LitTrainerCLI(args=[
        "fit", "--config", str(CONFIG), "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "false", "--trainer.enable_model_summary", "false", "--trainer.val_check_interval", "6",
        "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
        "--model.init_args.max_completion_length", "4", "--model.init_args.beta", "0.05",
        "--data.init_args.batch_size", "16", "--data.init_args.eval_batch_size", "16",
    ])  # fmt: skip
    assert isinstance(cli.model, RLOOModule) and cli.trainer.global_step == 3
    assert cli.model.ref_model is not None and cli.model.hparams.beta == 0.05
    metrics = cli.trainer.callback_metrics
    for key in ("reward", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/region_mean", "val_reward"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert "scale_rewards" not in cli.model.hparams and cli.model.hparams.normalize_advantages is False


# ---------------------------------------------------------------------------------------------------- DDP
def _independent_ddp_step(model: Any, ref: Any, rows: list[dict], lose_a_row: bool = False) -> dict:
    """One process, row by row without padding: rewards, per-sequence KL (policy at generation vs reference),
    leave-one-out baselines over each prompt's 4 rows from BOTH ranks, and the gradient of the mean over all 12 rows
    of ``-A exp(lp - sg(lp))`` (on-policy ratio 1). ``lose_a_row``: a real mistake, one row dropped from the loss."""
    import ddp_rloo as script

    model.zero_grad()

    def logp(m: Any, prompt: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=torch.cat([prompt, kept]).unsqueeze(0)).logits[0, prompt.numel() - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, kept.unsqueeze(-1)).sum()

    groups: dict[tuple, list[int]] = defaultdict(list)
    rewards, sums = [], []
    for i, r in enumerate(rows):
        prompt, kept = r["prompt_ids"][r["prompt_mask"].bool()], r["completion_ids"][r["completion_mask"].bool()]
        groups[tuple(prompt.tolist())].append(i)
        lp = logp(model, prompt, kept)
        with torch.no_grad():
            kl = lp.detach() - logp(ref, prompt, kept)
        rewards.append(script.length_reward([], [], [kept.tolist()])[0] - script.BETA * kl)
        sums.append(lp)
    advantages = [0.0] * len(rows)
    for members in groups.values():
        assert len(members) == script.G
        for i in members:
            advantages[i] = rewards[i] - sum(rewards[j] for j in members if j != i) / (script.G - 1)
    kept_rows = range(1, len(rows)) if lose_a_row else range(len(rows))
    loss = sum(-advantages[i] * torch.exp(sums[i] - sums[i].detach()) for i in kept_rows) / len(rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["advantages"] = torch.stack([torch.as_tensor(a) for a in advantages]).detach()
    return grads


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_step_gathers_groups_and_kl_across_ranks(ddp_world):
    import ddp_rloo as script

    from helpers.accumulation import calibrated

    out = ddp_world.part("rloo")  # tests/scripts/ddp_rloo.py
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in ranks)
    rows = [{k: v[i] for k, v in s.items()} for r in ranks for s in r["slices"] for i in range(len(s["advantages"]))]
    assert len(rows) == script.PROMPTS * script.G
    for r in ranks[1:]:  # DDP all-reduced the gradient: every rank holds the same
        for name, grad in r["grads"].items():
            assert torch.equal(grad, ranks[0]["grads"][name]), name
    ref = script.build_model()
    policy = script.perturb(script.build_model())
    expected = _independent_ddp_step(copy.deepcopy(policy), ref, rows)
    # advantages: float32 per-row sums against the module's batched ones: measured <= 1e-6; bound 1e-4 (|A| ~ 1-3; a
    # group baseline without the other rank's rows is off by > 0.3)
    got_advantages = torch.stack([r["advantages"] for r in rows])
    torch.testing.assert_close(got_advantages, expected.pop("advantages").float(), rtol=0, atol=1e-4)

    def gradient(m: Any, lose_a_row: bool = False) -> dict:
        dtype = next(m.parameters()).dtype
        grads = _independent_ddp_step(m, copy.deepcopy(ref).to(dtype), rows, lose_a_row)
        return {k: v for k, v in grads.items() if k != "advantages"}

    reference = calibrated(gradient, policy, mistake=lambda m: gradient(m, True), what="2-rank RLOO gradient")
    reference.check(ranks[0]["grads"])


# ---------------------------------------------------------------------------------------------------- resume
def test_resume_in_the_middle_of_a_round_is_exact(tmp_path):
    """RLOO with its KL in the reward (a frozen reference) and rounds of 4 optimizer steps: resumed from the
    checkpoint of step 2, inside the first round, the buffered round comes back (no regeneration: only the second
    round is generated again) and the run ends with the uninterrupted run's weights, bit for bit."""
    import lightning.pytorch as pl
    import transformers
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_grpo_module import QUIET, GenerateSpy, data, length_reward, tiny_model

    def fit(ckpt_path: str | None, callbacks: list) -> tuple[RLOOModule, GenerateSpy]:
        module = RLOOModule(
            tiny_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward], num_generations=4,
            max_completion_length=4, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0, generation_seed=0,
            beta=0.1, steps_per_generation=4,
        )  # fmt: skip
        spy = GenerateSpy(module)
        options = {**QUIET, "enable_checkpointing": bool(callbacks)}
        pl.Trainer(max_steps=6, callbacks=callbacks, default_root_dir=tmp_path, **options).fit(
            module, datamodule=data(20), ckpt_path=ckpt_path
        )
        return module, spy

    full, full_spy = fit(None, [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    resumed, resumed_spy = fit(str(tmp_path / "epoch=0-step=2.ckpt"), [])
    assert len(full_spy.calls) == 2 and resumed_spy.calls == full_spy.calls[1:]
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
