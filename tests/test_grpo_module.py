"""GRPOModule + PromptDataModule: data order, generation cadence, token-exact gradients, resume, rewards, config."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import pytest
import torch
import transformers
from datasets import Dataset

from helpers.accumulation import FullBatch, calibrated
from helpers.models import tiny_llama
from lit_trainer.data import builtin
from lit_trainer.data.prompt import GenerationBatchSampler, PromptDataModule, RolloutGeometry
from lit_trainer.generation import engines as rollout
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.rewards import RewardFunctionError, arithmetic_reward

datasets.disable_progress_bars()
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
CONFIG = Path(__file__).parents[1] / "configs" / "grpo.yaml"
QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def tiny_model(seed: int = 0, eos_bias: float = 3.0) -> transformers.LlamaForCausalLM:
    """The tests' tiny Llama with an output bias that makes EOS likely (~10% per token), so completion lengths and
    hence :func:`length_reward` vary within a group."""
    return tiny_llama(seed, eos_bias=eos_bias)


def prompts(n: int) -> Dataset:
    """``n`` addition prompts ``"a+b="`` with their ``answer`` column (a = 10..10+n-1, b = 11)."""
    return Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(n)], "answer": [str(21 + i) for i in range(n)]})


def length_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    """A cheap dense reward for mechanics tests: kept completion tokens, + 2 when the completion ended (EOS = 1)."""
    return [len(ids) + 2.0 * (ids[-1:] == [1]) for ids in completion_ids]


def grpo(model: Any = None, **kwargs: Any) -> GRPOModule:
    options = {
        "reward_funcs": [length_reward],
        "num_generations": 4,
        "max_completion_length": 4,
        "learning_rate": 1e-2,
        "scheduler": "constant",
        "max_grad_norm": 0.0,
        "generation_seed": 0,
    }
    options.update(kwargs)
    return GRPOModule(model if model is not None else tiny_model(), tokenizer=transformers.ByT5Tokenizer(), **options)


def data(n: int = 12, batch_size: int = 4, **kwargs: Any) -> PromptDataModule:
    options = {"max_length": 16, "val_size": 0, "sampling": "sequential", **kwargs}
    return PromptDataModule(
        tokenizer=transformers.ByT5Tokenizer(), dataset=prompts(n), batch_size=batch_size, **options
    )


class GenerateSpy:
    """Wraps ``model.generate``: counts calls and records the decoded prompts of each call."""

    def __init__(self, module: GRPOModule) -> None:
        self.module, self.inner, self.calls = module, module.model.generate, []
        module.model.generate = self

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        self.calls.append(self.module.tokenizer.batch_decode([r[m.bool()] for r, m in zip(ids, mask)]))
        return self.inner(*args, **kwargs)


class StepRecorder(L.Callback):
    """Records, at the first optimizer step, the gradients and the buffered rollouts that produced them."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.slices: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.clone() for n, p in pl_module.model.named_parameters()}
            self.slices = [dict(s) for s in pl_module._buffer.slices]


# ------------------------------------------------------------------------------------------- PromptDataModule
def test_prompts_drop_the_appended_eos_and_keep_reward_columns():
    dm = data(4)
    dm.setup("fit")
    # ByT5: byte + 3; "10+11=" -> '1'=52 '0'=51 '+'=46 '1'=52 '1'=52 '='=64; the appended EOS (1) is dropped
    assert dm.train_dataset[0]["prompt_input_ids"] == [52, 51, 46, 52, 52, 64]
    batch = dm._collate([dm.train_dataset[0], {**dm.train_dataset[1], "prompt_input_ids": [52, 64]}], True)
    assert batch["prompt_input_ids"].tolist() == [[52, 51, 46, 52, 52, 64], [0, 0, 0, 0, 52, 64]]  # left padded
    assert batch["prompt_attention_mask"].tolist() == [[1] * 6, [0, 0, 0, 0, 1, 1]]
    assert batch["prompts"] == ["10+11=", "11+11="]
    assert batch["reward_columns"] == {"answer": ["21", "22"]}  # no prompt, ids or length columns


def test_too_long_and_empty_prompts_are_dropped_and_counted():
    rows = Dataset.from_dict({"prompt": ["1+1=", "", "9" * 20], "answer": ["2", "0", "9"]})
    dm = PromptDataModule(tokenizer=transformers.ByT5Tokenizer(), dataset=rows, batch_size=2, max_length=16, val_size=0)
    dm.setup("fit")
    assert dm.train_dataset["prompt"] == ["1+1="]  # 20 bytes > 16 tokens; "" has no token (never truncated)
    assert dm.stats["train_prompts_too_long"] == 1 and dm.stats["train_prompts_empty"] == 1


def test_completions_are_cut_after_the_first_eos_and_measured():
    done = rollout.cut_after_eos(torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 9, 9, 9]]), [1], pad_token_id=0)
    assert done.ids.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0]]  # EOS kept, the rest padded
    assert done.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert done.truncated.tolist() == [False, True, False]  # row 2 never produced an EOS
    metrics = rollout.completion_metrics(done.mask.sum(1), done.truncated)
    # lengths 2, 4, 1 -> mean 7/3, min 1, max 4, clipped 1/3; terminated rows only: 2, 1 -> mean 1.5, min 1, max 2
    expected = {
        "mean_length": 7 / 3,
        "min_length": 1,
        "max_length": 4,
        "clipped_ratio": 1 / 3,
        "mean_terminated_length": 1.5,
        "min_terminated_length": 1,
        "max_terminated_length": 2,
    }
    for key, value in expected.items():
        # tolerance (approx's rel 1e-6): token counts and their float32 means against hand values
        assert metrics[f"completions/{key}"].item() == pytest.approx(value), key


def test_conversational_prompts_use_the_chat_template():
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1="}]], "answer": ["2"]})
    tokenizer = transformers.ByT5Tokenizer()
    dm = PromptDataModule(tokenizer=tokenizer, dataset=rows, batch_size=2, val_size=0)
    with pytest.raises(ValueError, match="no chat template"):
        dm.setup("fit")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    dm = PromptDataModule(tokenizer=tokenizer, dataset=rows, batch_size=2, val_size=0)
    dm.setup("fit")
    assert dm.train_dataset[0]["prompt_input_ids"] == [52, 46, 52, 64, 65]  # "1+1=>" (no EOS added by the template)


def test_generation_loader_yields_whole_local_generation_batches_in_repeat_sampler_order():
    dm = data(6, batch_size=2)
    dm.setup("fit")
    geometry = RolloutGeometry(num_generations=2, steps_per_generation=2, generation_batch_size=4, num_iterations=2)
    loader = dm.generation_loader(geometry)
    assert isinstance(loader.batch_sampler, GenerationBatchSampler)
    seen = [b["prompts"] for b in loader]
    # gbs/G = 2 prompts per chunk, 3 chunks; each local batch (b*spg = 4 rows) repeated mu*spg = 4 times
    first = ["10+11=", "10+11=", "11+11=", "11+11="]
    assert seen[:4] == [first] * 4 and seen[4] == ["12+11=", "12+11=", "13+11=", "13+11="] and len(seen) == 12
    # two ranks: contiguous slices of each generation batch, so each rank generates for its own prompts
    rank1 = [
        b["prompts"] for b in dm.generation_loader(geometry._replace(generation_batch_size=4), num_replicas=2, rank=1)
    ]
    assert rank1[0] == ["11+11=", "11+11="] and len(rank1) == 12


def test_options_are_validated_with_a_fix_in_the_message():
    with pytest.raises(ValueError, match="num_generations=1"):
        grpo(num_generations=1)
    with pytest.raises(ValueError, match="mutually exclusive"):
        grpo(steps_per_generation=2, generation_batch_size=8)
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        grpo(loss_type="ppo")
    with pytest.raises(ValueError, match="reward_weights"):
        grpo(reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="cannot be imported"):
        grpo(reward_funcs=["lit_trainer.rewards.no_such_reward"])
    with pytest.raises(ValueError, match="sampling='group_by_length'"):
        data(sampling="group_by_length")
    # b=3, G=4, spg=1: 3 completions per generation batch is not a multiple of 4 -> use spg=4
    trainer = L.Trainer(max_steps=1, **QUIET)
    with pytest.raises(ValueError, match="steps_per_generation=4"):
        trainer.fit(grpo(steps_per_generation=1), datamodule=data(batch_size=3))


@pytest.mark.slow
def test_reward_functions_from_import_paths_and_errors_name_the_function():
    module = grpo(reward_funcs="lit_trainer.rewards.arithmetic_reward")
    assert module.reward_funcs == [arithmetic_reward] and module.hparams.reward_funcs == [
        "lit_trainer.rewards.arithmetic_reward"
    ]

    def broken_reward(prompts, completions, completion_ids, **kw):
        raise KeyError("boom")

    def short_reward(prompts, completions, completion_ids, **kw):
        return [1.0]

    cases = ((broken_reward, "`broken_reward` raised KeyError"), (short_reward, "`short_reward` returned 1 values"))
    for func, message in cases:
        with pytest.raises(RewardFunctionError, match=message):
            L.Trainer(max_steps=1, **QUIET).fit(grpo(reward_funcs=[func]), datamodule=data())


# ------------------------------------------------------------------------------------------ generation cadence
@pytest.mark.parametrize(
    ("accumulate", "options", "steps", "expected_calls", "rows"),
    [
        (1, {"steps_per_generation": 4}, 8, 2, 16),  # 8 optimizer steps / spg 4 = 2 generations of b*spg = 16 rows
        (2, {}, 3, 3, 8),  # default spg = accumulate = 2: one generation per optimizer step (8 rows)
        (1, {"generation_batch_size": 8, "num_iterations": 2}, 8, 2, 8),  # spg 2, mu 2: 4 micro-steps per round
    ],
)
@pytest.mark.slow
def test_generate_is_called_once_per_round_with_each_prompt_num_generations_times(
    accumulate, options, steps, expected_calls, rows
):
    module = grpo(**options)
    spy = GenerateSpy(module)
    served = []
    inner = module.compute_loss

    def counting_compute_loss(batch: dict, num_items: Any) -> Any:
        served.append(batch["advantages"].shape[0])
        return inner(batch, num_items)

    module.compute_loss = counting_compute_loss
    L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, **QUIET).fit(module, datamodule=data(20))
    assert len(spy.calls) == expected_calls
    for call in spy.calls:
        assert len(call) == rows
        unique = list(dict.fromkeys(call))
        assert len(unique) == rows // 4 and all(call.count(p) == 4 for p in unique)  # G = 4 copies of each prompt
    assert served == [4] * (steps * accumulate)  # every micro-step trains on b = 4 buffered rows


# --------------------------------------------------------------------------------- token-exact accumulation
def _independent_step_gradient(
    model: Any, slices: list[dict], loss_type: str, temperature: float, lose_a_row: bool = False
) -> dict:
    """On-policy gradient written out row by row, without padding: per token ``L = -A * exp(lp - sg(lp))``.

    dapo: sum over every kept token of the step / (kept tokens of the step); grpo: mean over rows of the row's
    token mean (equal-size micro-batches, so the mean of micro-batch means is the full-batch mean). In the model's
    dtype (a float64 model: the float64 twin of a calibration, ``helpers.accumulation.calibrated``).
    ``lose_a_row``: a real mistake's gradient, the first row with a kept token left out (loss and normaliser).
    """
    model.zero_grad()
    rows = [{k: s[k][i] for k in s} for s in slices for i in range(s["advantages"].shape[0])]
    if lose_a_row:
        rows.pop(next(i for i, r in enumerate(rows) if r["completion_mask"].sum() > 0))
    total_tokens = sum(int(r["completion_mask"].sum()) for r in rows)
    loss = 0.0
    for r in rows:
        prompt = r["prompt_ids"][r["prompt_mask"].bool()]
        kept = r["completion_ids"][r["completion_mask"].bool()]
        if kept.numel() == 0:
            continue
        ids = torch.cat([prompt, kept]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1] / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, kept.unsqueeze(-1)).squeeze(-1)
        token_loss = -r["advantages"] * torch.exp(lp - lp.detach())
        loss = loss + (token_loss.sum() / total_tokens if loss_type == "dapo" else token_loss.mean() / len(rows))
    if not torch.is_tensor(loss):  # no row with a kept token (``lose_a_row`` took the only one): no gradient
        return {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("loss_type", "mask_truncated"), [("dapo", False), ("dapo", True), ("grpo", False)])
def test_accumulated_step_gradient_equals_the_full_batch_gradient(loss_type, mask_truncated):
    model = tiny_model(3)
    initial = copy.deepcopy(model)
    recorder = StepRecorder()
    module = grpo(
        model,
        loss_type=loss_type,
        temperature=0.8,
        mask_truncated_completions=mask_truncated,
        max_completion_length=3 if mask_truncated else 6,
    )
    trainer = L.Trainer(max_steps=1, accumulate_grad_batches=2, callbacks=[recorder], **QUIET)
    trainer.fit(module, datamodule=data(batch_size=4))
    assert len(recorder.slices) == 2  # spg = GA = 2: the step's 8 rows are the two buffered micro-batches
    assert "old_logps" not in recorder.slices[0]  # on-policy: no old log-probs are computed
    if mask_truncated:  # some rows hit max_completion_length without EOS and are out of the loss
        assert 0 < sum(int((s["completion_mask"].sum(1) == 0).sum()) for s in recorder.slices) < 8
    expected = step_reference(initial, recorder.slices, loss_type, 0.8)
    expected.check(recorder.grads)
    assert any(g.abs().sum() > 0 for g in expected.grads.values())


def step_reference(model: Any, slices: list[dict], loss_type: str, temperature: float) -> FullBatch:
    """:func:`_independent_step_gradient` with its calibrated tolerance: its float32 rounding against its float64
    twin (``tests/helpers/rounding.py``); a real mistake: a row lost."""
    return calibrated(
        lambda m: _independent_step_gradient(m, slices, loss_type, temperature),
        model,
        mistake=lambda m: _independent_step_gradient(m, slices, loss_type, temperature, lose_a_row=True),
        what=f"{loss_type} step gradient",
    )


def test_off_policy_rounds_store_old_logps_equal_to_the_sampling_policy():
    module = grpo(num_iterations=2)  # GA=1, spg=1, mu=2: the second pass runs after an update -> off-policy
    recorder = StepRecorder()
    L.Trainer(max_steps=1, callbacks=[recorder], **QUIET).fit(module, datamodule=data(batch_size=16))
    rows = recorder.slices[0]
    assert rows["advantages"].abs().sum() > 0
    logps, _ = module.completion_logps(module.model, rows)  # weights after one step
    assert "old_logps" in rows
    initial_logps, _ = GRPOModule.completion_logps(module, tiny_model(), rows)
    mask = rows["completion_mask"].bool()
    torch.testing.assert_close(rows["old_logps"][mask], initial_logps.detach()[mask], rtol=1e-5, atol=1e-5)
    assert (logps.detach()[mask] - rows["old_logps"][mask]).abs().max() > 1e-4  # the policy moved


# ------------------------------------------------------------------------------------------ reference model
def test_beta_keeps_a_frozen_reference_copy_and_logs_kl():
    initial = tiny_model()
    module = grpo(beta=0.1)
    assert module.ref_model is not None and not any(p.requires_grad for p in module.ref_model.parameters())
    assert grpo().ref_model is None  # beta = 0: no reference model at all
    recorder = StepRecorder()
    trainer = L.Trainer(max_steps=2, log_every_n_steps=1, callbacks=[recorder], **QUIET)
    trainer.fit(module, datamodule=data(batch_size=8))
    assert module.model.training and not module.ref_model.training  # Lightning's train() leaves the reference alone
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in module.ref_model.parameters()}
    for (name, ref), (_, start) in zip(module.ref_model.state_dict().items(), initial.state_dict().items()):
        assert torch.equal(ref, start), name  # the reference is the initial policy, never updated
    assert "ref_logps" in recorder.slices[0]
    kl = trainer.callback_metrics["kl"]  # step 2: the policy moved once, so k3 > 0 but small
    assert 0 < kl < 1


# ---------------------------------------------------------------------------------------------------- resume
def test_resume_in_the_middle_of_a_generation_round_is_exact(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(ckpt_path: str | None, callbacks: list) -> tuple[GRPOModule, GenerateSpy]:
        module = grpo(steps_per_generation=4)
        spy = GenerateSpy(module)
        options = {**QUIET, "enable_checkpointing": bool(callbacks)}
        L.Trainer(max_steps=6, callbacks=callbacks, default_root_dir=tmp_path, **options).fit(
            module, datamodule=data(20), ckpt_path=ckpt_path
        )
        return module, spy

    # rounds start at steps 0 and 4; the checkpoint of step 2 is in the middle of the first round
    full, full_spy = fit(None, [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    checkpoint = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)
    saved = checkpoint["grpo_rollouts"]
    assert saved["world_size"] == 1 and saved["ranks"][0]["served"] == 2 and len(saved["ranks"][0]["slices"]) == 4
    resumed, resumed_spy = fit(str(tmp_path / "epoch=0-step=2.ckpt"), [])
    assert len(full_spy.calls) == 2 and resumed_spy.calls == full_spy.calls[1:]  # the buffer came back, no regeneration
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_mean_reward_rises_from_a_briefly_sft_trained_model():
    """Tiny-64 SFT for 80 steps on 64 addition problems (about 20-30% of sampled answers right), then GRPO with the
    correctness reward on 16 of them, every step on the same 16 prompts x 8 samples (so the curve is not dominated
    by which prompts were drawn)."""
    from lit_trainer.data.sft import SFTDataModule
    from lit_trainer.modules.causal_lm import CausalLMModule

    L.seed_everything(0)
    sft = CausalLMModule("tiny-64", learning_rate=3e-3, warmup_steps=10, scheduler="constant_with_warmup")
    sft_data = SFTDataModule(
        tokenizer="tiny", dataset=builtin.sft_rows("train").select(range(64)), batch_size=64, max_length=32, val_size=0
    )
    L.Trainer(max_steps=80, **QUIET).fit(sft, datamodule=sft_data)
    module = GRPOModule(
        sft.model,
        tokenizer=sft.tokenizer,
        reward_funcs=["lit_trainer.rewards.arithmetic_reward"],
        num_generations=8,
        max_completion_length=4,
        temperature=0.7,
        learning_rate=3e-4,
        scheduler="constant",
        generation_seed=0,
    )
    rewards: list[float] = []

    class Rewards(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
            rewards.append(float(pl_module._buffer.metrics["reward"]))

    prompt_data = PromptDataModule(
        tokenizer="tiny",
        dataset=builtin.prompt_rows("train").select(range(16)),
        batch_size=128,
        max_length=16,
        val_size=0,
    )
    L.Trainer(max_steps=25, callbacks=[Rewards()], **QUIET).fit(module, datamodule=prompt_data)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert 0.05 < first < 0.6, rewards  # partly trained: GRPO has a signal to work with
    assert last > first + 0.1, rewards


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.slow
def test_grpo_config_parses_and_runs_a_few_steps(tmp_path, monkeypatch):
    from lit_trainer.cli import LitTrainerCLI

    monkeypatch.chdir(tmp_path)
    cli = LitTrainerCLI(args=[
        "fit", "--config", str(CONFIG), "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "false", "--trainer.enable_model_summary", "false",
        "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
        "--model.init_args.max_completion_length", "4", "--data.init_args.batch_size", "32",
        "--data.init_args.eval_batch_size", "32",
    ])  # fmt: skip
    assert isinstance(cli.model, GRPOModule) and isinstance(cli.datamodule, PromptDataModule)
    assert cli.model.reward_funcs == [arithmetic_reward] and cli.model.ref_model is None
    assert cli.trainer.global_step == 2
    assert cli.model.rollout_geometry == RolloutGeometry(8, 2, 64, 1)  # spg = accumulate_grad_batches = 2
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/arithmetic_reward/mean",
        "entropy",
        "completions/mean_length",
        "completions/clipped_ratio",
        "clip_ratio/region_mean",
        "val_reward",
    ):
        assert key in cli.trainer.callback_metrics, key


def test_eval_do_sample_validates_on_seeded_samples_and_leaves_the_training_rng_alone():
    """Greedy validation (default) is the argmax completion; ``eval_do_sample`` samples with the training settings, on
    its own seeded stream: the same weights validate to the same samples, and the global RNG is untouched."""
    seen: list[list[str]] = []

    def recorder(prompts: list, completions: list, **_: Any) -> list[float]:
        seen.append(list(completions))
        return [0.0] * len(completions)

    def validate(**kwargs: Any) -> list[str]:
        module = grpo(reward_funcs=[recorder], max_completion_length=8, temperature=1.0, **kwargs)
        dm = data(n=12, val_size=8, eval_batch_size=8)
        seen.clear()
        L.Trainer(**{**QUIET, "limit_val_batches": 1}).validate(module, datamodule=dm)
        return seen[0]

    greedy = validate()
    before = torch.get_rng_state()
    sampled = validate(eval_do_sample=True)
    assert torch.equal(torch.get_rng_state(), before)  # validation sampled from its own forked stream
    assert validate(eval_do_sample=True) == sampled  # seeded: the same weights give the same samples
    assert validate() == greedy
    assert sampled != greedy  # at temperature 1 the random tiny model's samples are not its argmax
    assert validate(eval_do_sample=True, generation_seed=1) != sampled
