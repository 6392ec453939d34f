"""The customizing examples (examples/customizing/, docs/customizing.md, CONTRIBUTING.md) do what the guide says."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import yaml
from datasets import Dataset

from examples.customizing.batching import CurriculumSampler, CurriculumSFTDataModule
from examples.customizing.dpop import DPOPModule, dpop_loss
from examples.customizing.focal_loss import FocalLossLM, focal_causal_lm_loss
from examples.customizing.optimizer import EmbeddingLRModule
from examples.customizing.reinforce import REINFORCEModule, reinforce_advantages, reinforce_loss
from helpers.accumulation import TEXTS, GradCapture, accum_datamodule, calibrated
from helpers.ddp import run_lit_trainer
from helpers.models import tiny_llama
from lit_trainer.data import PreferenceDataModule, SFTDataModule
from lit_trainer.data.loader import TrainLoader
from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.losses.dpo import dpo_loss
from lit_trainer.modules.causal_lm import CausalLMModule

ROOT = Path(__file__).resolve().parents[1]


def _trainer(callbacks=(), **kw) -> pl.Trainer:
    kw = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "accelerator": "cpu",
        "devices": 1,
        **kw,
    }
    return pl.Trainer(callbacks=list(callbacks), **kw)


def _random_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, 11, generator=generator)
    labels = torch.randint(0, 11, (3, 7), generator=generator)
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    return logits, labels


# ------------------------------------------------------------------------------------------------------ focal loss
def test_focal_loss_with_gamma_zero_is_the_standard_loss():
    logits, labels = _random_batch()
    for count in (None, torch.tensor(40)):
        torch.testing.assert_close(
            focal_causal_lm_loss(logits, labels, count, gamma=0.0),
            causal_lm_loss(logits, labels, count),
            rtol=1e-6,
            atol=0.0,
        )


def test_focal_loss_down_weights_confident_tokens_by_hand():
    # one target token with two equally likely ids: p = 0.5, CE = log 2, focal(γ=2) = (1 - 0.5)² · log 2
    logits, labels = torch.zeros(1, 2, 2), torch.tensor([[0, 1]])
    value = focal_causal_lm_loss(logits, labels, None, gamma=2.0)
    assert value.item() == pytest.approx(0.25 * torch.log(torch.tensor(2.0)).item(), rel=1e-6)


def _focal_full_batch_gradient(model, dm, rows: list[int], gamma: float) -> dict[str, torch.Tensor]:
    """Focal loss averaged over all target tokens of ``rows`` in ONE forward, and its gradient."""
    batch = dm._collate([dm.train_dataset[i] for i in rows], True)
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if logits.dtype == torch.float64:  # the calibration's float64 twin: the example's formula without its float32 cast
        ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none")  # 0: ignored
        ((1.0 - torch.exp(-ce)) ** gamma * ce).sum().div((batch["labels"][:, 1:] != -100).sum()).backward()
    else:
        focal_causal_lm_loss(logits, batch["labels"], None, gamma).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _uneven_halves(tokenizer) -> SFTDataModule:
    """The 4 shortest rows, then the 4 longest: two micro-batches of 4 rows, 8 and 130 target tokens."""
    texts = sorted(TEXTS, key=len)
    dm = SFTDataModule(tokenizer=tokenizer, dataset=Dataset.from_dict({"text": texts}), val_size=0, batch_size=4,
                       max_length=64, sampling="sequential")  # fmt: skip
    dm.setup("fit")
    halves = [dm._collate([dm.train_dataset[i] for i in range(k, k + 4)], True) for k in (0, 4)]
    tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in halves]
    assert tokens[1] > 5 * tokens[0], tokens
    return dm


def _step_gradient(module, dm) -> dict[str, torch.Tensor]:
    """The gradient of one optimizer step over the data module's two micro-batches (accumulated), before clipping."""
    capture = GradCapture()
    _trainer([capture], max_steps=1, accumulate_grad_batches=2).fit(module, datamodule=dm)
    assert len(capture.grads) == 1
    return capture.grads[0]


def _halves_gradient(model, dm) -> dict[str, torch.Tensor]:
    """The sum of the two micro-batches' own focal-mean gradients."""
    parts = [_focal_full_batch_gradient(model, dm, list(range(k, k + 4)), 2.0) for k in (0, 4)]
    return {k: parts[0][k] + parts[1][k] for k in parts[0]}


def test_focal_loss_window_gradient_equals_full_batch(tokenizer):
    model, dm = tiny_llama(seed=4), _uneven_halves(tokenizer)
    # tolerance: the full-batch gradient's float32 rounding against its float64 twin (helpers/rounding.py); a real
    # mistake, averaging the two micro-batch means (what a per-batch mean loss gives), must be far from it (> 0.05)
    reference = calibrated(
        lambda m: _focal_full_batch_gradient(m, dm, list(range(8)), gamma=2.0),
        model,
        mistake=lambda m: {k: v / 2 for k, v in _halves_gradient(m, dm).items()},
        what="focal full-batch gradient",
    )
    assert reference.mistake > 0.05
    module = FocalLossLM(copy.deepcopy(model), tokenizer=tokenizer, gamma=2.0, learning_rate=0.0, max_grad_norm=None)
    reference.check(_step_gradient(module, dm))


class _PerBatchMeanFocal(FocalLossLM):
    """What the guide warns against: the micro-batch's own mean, ignoring the step's count."""

    def compute_loss(self, batch, num_items_in_batch):
        return super().compute_loss(batch, None)


def test_a_per_batch_mean_is_off_by_the_accumulation_factor(tokenizer):
    """docs/customizing.md: with the count given, a per-micro-batch mean gives N times the mean of the means."""
    model, dm = tiny_llama(seed=4), _uneven_halves(tokenizer)
    # calibrated like the test above; a real mistake here is the mean of the means (the count honoured): off by half
    expected = calibrated(lambda m: _halves_gradient(m, dm), model, mistake=0.5, what="sum of micro-batch means")
    module = _PerBatchMeanFocal(copy.deepcopy(model), tokenizer=tokenizer, learning_rate=0.0, max_grad_norm=None)
    expected.check(_step_gradient(module, dm))


def test_focal_loss_rejects_a_negative_gamma():
    with pytest.raises(ValueError, match=r"gamma=-1.0.*gamma >= 0"):
        FocalLossLM(tiny_llama(), gamma=-1.0)


# -------------------------------------------------------------------------------------------------------- batching
class _BatchRecorder(pl.Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append((trainer.current_epoch, batch["attention_mask"].sum(-1).tolist()))


def test_curriculum_data_module_yields_shortest_rows_first_then_shuffles(tokenizer):
    dm = CurriculumSFTDataModule(
        tokenizer=tokenizer,
        dataset=accum_datamodule(tokenizer).dataset_source,
        val_size=0,
        batch_size=2,
        max_length=64,
        curriculum_epochs=1,
    )
    recorder = _BatchRecorder()
    module = CausalLMModule(tiny_llama(seed=5), tokenizer=tokenizer, learning_rate=1e-3)
    _trainer([recorder], max_epochs=2).fit(module, datamodule=dm)
    lengths = sorted(len(tokenizer(t)["input_ids"]) for t in TEXTS)  # the tokenizer ends each row with EOS
    by_epoch = {e: [n for epoch, rows in recorder.batches if epoch == e for n in rows] for e in (0, 1)}
    assert [rows for epoch, rows in recorder.batches if epoch == 0] == [lengths[i : i + 2] for i in (0, 2, 4, 6)]
    assert sorted(by_epoch[1]) == lengths and by_epoch[1] != lengths  # every row once, no longer sorted


def test_curriculum_sampler_resumes_on_the_same_rows(tokenizer):
    """The TrainLoader resumes by seeking the sampler to the next micro-batch: an order that is a function of (seed,
    epoch, rank) gives the uninterrupted run's remaining batches, in both the sorted and the shuffled epochs."""
    dm = SFTDataModule(tokenizer=tokenizer, dataset=Dataset.from_dict({"text": TEXTS}), val_size=0, max_length=64)
    dm.setup("fit")

    def loader(epoch: int, position: int = 0) -> list[list[int]]:
        sampler = CurriculumSampler(dm.lengths(), 2, seed=3, world=1, rank=0, epochs=1)
        train = TrainLoader(dm.train_dataset, sampler, lambda rows: dm._collate(rows, True), count_items=dm.count_items)
        train.load_state_dict({"epoch": epoch, "position": position})
        return [batch["attention_mask"].sum(-1).tolist() for batch in train]

    for epoch in (0, 1):
        full = loader(epoch)
        assert len(full) == 4 and loader(epoch, position=3) == full[3:] and loader(epoch, position=1) == full[1:]
    assert loader(0) != loader(1)


# ------------------------------------------------------------------------------------------------------- optimizer
def test_optimizer_override_gives_the_embeddings_their_own_rate(tokenizer):
    model = tiny_llama(seed=6)
    before = model.get_input_embeddings().weight.detach().clone()
    module = EmbeddingLRModule(
        model, tokenizer=tokenizer, learning_rate=1e-2, embedding_lr_ratio=0.1, scheduler="constant"
    )
    trainer = _trainer(max_steps=2)
    trainer.fit(module, datamodule=accum_datamodule(tokenizer, batch_size=4))
    optimizer = trainer.optimizers[0]
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([1e-2, 1e-3])
    assert optimizer.param_groups[1]["params"] == [model.get_input_embeddings().weight]
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer  # the schedule drives this optimizer
    assert not torch.equal(model.get_input_embeddings().weight, before)  # and it trained


# ------------------------------------------------------------------------------------------ a new preference loss
def test_dpop_loss_with_lambda_zero_is_sigmoid_dpo_and_penalises_a_falling_chosen():
    generator = torch.Generator().manual_seed(0)
    pi_c, pi_r, ref_c, ref_r = (torch.randn(6, generator=generator) * 3 for _ in range(4))
    sigmoid = dpo_loss(pi_c, pi_r, ref_c, ref_r, loss_type="sigmoid", beta=0.1)
    torch.testing.assert_close(dpop_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1, dpop_lambda=0.0), sigmoid)
    penalised = dpop_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1, dpop_lambda=5.0)
    falling = pi_c < ref_c
    assert falling.any() and (~falling).any()
    assert torch.equal(penalised[~falling], sigmoid[~falling]) and bool((penalised[falling] > sigmoid[falling]).all())


def _preference_batch(tokenizer) -> dict[str, torch.Tensor]:
    rows = {"prompt": ["1+2=", "10+20=", "5+5="], "chosen": ["3", "30", "10"], "rejected": ["4", "31", "55"]}
    dm = PreferenceDataModule(tokenizer=tokenizer, dataset=Dataset.from_dict(rows), val_size=0, max_length=32)
    dm.setup("fit")
    return dm._collate([dm.train_dataset[i] for i in range(3)], True)


def _sequence_logps(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    token = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (token * batch["completion_mask"][:, 1:]).sum(-1)


def test_dpop_module_uses_the_reference_model_and_keeps_dpo_metrics(tokenizer):
    module = DPOPModule(tiny_llama(seed=7), tokenizer=tokenizer, dpop_lambda=5.0, beta=0.5)
    batch = _preference_batch(tokenizer)
    with torch.no_grad():
        torch.nn.init.normal_(module.model.model.embed_tokens.weight)  # the policy moves away from its reference
        loss, metrics = module.compute_loss(dict(batch), None)
        pi, ref = _sequence_logps(module.model, batch), _sequence_logps(module.ref_model, batch)
    expected = dpop_loss(pi[:3], pi[3:], ref[:3], ref[3:], beta=0.5, dpop_lambda=5.0).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert {"rewards/margins", "rewards/accuracies", "logps/chosen", "logits/rejected"} <= set(metrics)
    with torch.no_grad():
        module.ref_model.model.embed_tokens.weight.mul_(2.0)  # another reference: another loss
        assert not torch.allclose(module.compute_loss(dict(batch), None)[0], loss)


@pytest.mark.slow  # a console-script process: imports and two steps, about 20 s
def test_dpop_config_trains_two_steps_from_the_command_line(tmp_path):
    config = ROOT / "examples" / "customizing" / "dpop.yaml"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = run_lit_trainer(
        "fit",
        "--config",
        config,
        "--trainer.max_steps",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        cwd=tmp_path,
        PYTHONPATH=pythonpath,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "dpopmodule" / "version_0"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["class_path"] == "examples.customizing.dpop.DPOPModule"
    assert saved["model"]["init_args"]["dpop_lambda"] == 50.0
    rows = (run / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and "rewards/margins" in rows[0].split(",")  # two steps, DPO's metrics


def test_reinforce_advantages_and_loss_by_hand():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, float("nan")]])
    # weighted sums with weights (1, 2): 1, 2, 3, 0 (NaN counts 0); their mean 1.5 is every row's baseline
    advantages = reinforce_advantages(rewards, [1.0, 2.0])
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 0.5, 1.5, -1.5]))
    torch.testing.assert_close(reinforce_advantages(rewards[:, :1]), torch.tensor([0.5, -0.5, 0.5, -0.5]))
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    loss = reinforce_loss(logps, adv, mask)
    # -(2 * (-1 - 2) + (-1) * (-0.5 - 0.5 - 9)) / 2 = -(-6 + 10) / 2 = -2
    torch.testing.assert_close(loss, torch.tensor(-2.0))
    loss.backward()  # d/d logp_it = -A_i * mask_it / rows
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.5, 0.5, 0.5]]))


def test_reinforce_module_trains_on_the_batch_baseline_from_its_config():
    """The example config, parsed by the CLI as `lit-trainer fit` parses it (in process, two short steps): the
    advantages the module buffers are the recorded rewards minus their mean, and the policy moves."""
    from lit_trainer.cli import LitTrainerCLI
    from lit_trainer.cli.runs import default_run_name

    recorded, buffered = [], []

    def counting_reward(prompts, completions, completion_ids, **columns):
        values = [float(sum(ids) % 7) for ids in completion_ids]  # varies between sampled completions
        recorded.append(torch.tensor(values))
        return values

    class Recording(REINFORCEModule):
        def _buffer_round(self, rows, metrics):
            buffered.append((rows["advantages"].clone(), metrics))
            super()._buffer_round(rows, metrics)

    config = ROOT / "examples" / "customizing" / "reinforce.yaml"
    args = ["--config", str(config), "--trainer.logger=false", "--trainer.max_steps=2", "--trainer.limit_val_batches=0"]
    args += ["--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
    args += [
        "--model.init_args.num_generations=4",
        "--data.init_args.batch_size=16",
        "--model.init_args.learning_rate=0.01",
    ]
    cli = LitTrainerCLI(args=args, run=False)
    assert type(cli.model) is REINFORCEModule and cli.model.hparams.beta == 0.0
    options = {k: v for k, v in cli.model.hparams.items() if k not in ("model", "reward_funcs") and k[0] != "_"}
    module = Recording("tiny", reward_funcs=[counting_reward], **options)  # the config's options, a recording module
    before = [p.detach().clone() for p in module.model.parameters()]
    cli.trainer.fit(module, datamodule=cli.datamodule)
    assert len(buffered) == 2 and len(recorded) == 2  # one round per optimizer step (steps_per_generation = 1)
    for rewards, (advantages, metrics) in zip(recorded, buffered):
        assert rewards.std() > 0  # something to learn from
        torch.testing.assert_close(advantages, rewards - rewards.mean())
        torch.testing.assert_close(metrics["reward"], rewards.mean())
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert default_run_name("examples.customizing.reinforce.REINFORCEModule") == "reinforce"
