"""Rounds sampled in the training process by an engine with its own numerics (vLLM's case), RLOO's and synchronous
GRPO's: the engine's log-probs correct the loss (RLOO: each sequence's) and are checked against the trainer's every
round.

vLLM itself is in tests/test_vllm_rloo.py and tests/test_vllm_grpo.py. Here a stand-in engine samples with
``generate`` and reports log-probs exactly ``SHIFT`` below the trainer's, so the correction and the check have known
values: the gap is ``SHIFT`` per token and a sequence of ``L`` tokens gets the ratio ``exp(SHIFT * L)``, masked (0)
above the bound 3.0.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pandas as pd
import pytest
import torch
import transformers
from lightning.pytorch.loggers import CSVLogger
from test_grpo_module import QUIET, data, grpo, length_reward, tiny_model

from lit_trainer.generation.engines import Completions, GenerateEngine
from lit_trainer.losses.rloo import rloo_policy_loss
from lit_trainer.modules.online_rl._logps import CompletionScorer
from lit_trainer.modules.rloo import RLOOModule

SHIFT = 0.3  # lengths 1..3 give ratios 1.35, 1.82, 2.46; length 4 gives 3.32 > 3.0, masked
# two forwards of the same rows in other batch shapes (the engine scores the whole round at once, the trainer in
# micro-batches) agree to float32 rounding: about 1e-7 per token on this model, bounded as the vLLM tests bound it
ROUNDING = 1e-4


class ShiftedEngine(GenerateEngine):
    """``generate``'s completions with log-probs ``shift`` below the trainer's (an engine with other numerics)."""

    same_numerics = False

    def __init__(self, shift: float = SHIFT) -> None:
        self.shift = shift

    def generate(self, model, prompt_ids, prompt_mask, config, eos_ids, *, synced=False, should_stop=None, **images):
        out = super().generate(model, prompt_ids, prompt_mask, config, eos_ids, synced=synced, should_stop=should_stop)
        rows = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": out.ids}
        rows["completion_mask"] = out.mask
        with torch.no_grad():
            logps = CompletionScorer(temperature=config.temperature)(model, rows)
        return Completions(out.ids, out.mask, out.truncated, (logps - self.shift) * out.mask)


class Recorded(RLOOModule):
    """Keeps each micro-step's loss and the rows it was computed on."""

    def compute_loss(self, batch: dict[str, Any], num_items_in_batch: Any) -> tuple:
        loss, metrics = super().compute_loss(batch, num_items_in_batch)
        kept = {k: batch[k].detach().clone() for k in ("completion_mask", "advantages")}
        self.seen.append((loss.detach().clone(), kept, dict(batch)))
        return loss, metrics


def _fit(tmp_path, steps: int = 2, **options: Any) -> tuple[Recorded, pd.DataFrame]:
    L.seed_everything(0)
    settings = {
        "reward_funcs": [length_reward], "num_generations": 4, "max_completion_length": 4, "beta": 0.0,
        "learning_rate": 1e-2, "scheduler": "constant", "max_grad_norm": 0.0, "generation_seed": 0,
        "rollout_engine": f"{__name__}.ShiftedEngine", **options,
    }  # fmt: skip
    module = Recorded(tiny_model(), tokenizer=transformers.ByT5Tokenizer(), **settings)
    module.seen = []
    logger = CSVLogger(tmp_path, name="log")
    trainer = L.Trainer(max_steps=steps, log_every_n_steps=1, **{**QUIET, "logger": logger})
    trainer.fit(module, datamodule=data(n=8, batch_size=8))
    return module, pd.read_csv(f"{logger.log_dir}/metrics.csv")


def test_the_loss_weights_each_sequence_by_its_correction_hand_values():
    logps = torch.zeros(3, 2, requires_grad=True)  # on-policy: every ratio is 1
    advantages, mask = torch.tensor([1.0, -1.0, 2.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    rho = torch.tensor([[2.0], [0.5], [0.0]])  # the third sequence masked by the correction
    loss = rloo_policy_loss(logps, None, advantages, mask, importance_sampling_ratio=rho)
    assert loss.item() == pytest.approx((-2.0 * 1 + 0.5 * 1 - 0.0 * 2) / 3)
    loss.backward()  # d/dlogp_it = -rho_i A_i m_it / B
    expected = torch.tensor([[-2 / 3, -2 / 3], [0.5 / 3, 0.0], [0.0, 0.0]])
    assert torch.allclose(logps.grad, expected)
    with pytest.raises(ValueError, match="one ratio per sequence"):
        rloo_policy_loss(logps, None, advantages, mask, importance_sampling_ratio=torch.ones(3, 2))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rollout_importance_sampling_mode": "token_mask"}, "one per sequence"),
        ({"rollout_importance_sampling_mode": "sequence_truncate", "rollout_importance_sampling_clip_max": None},
         "needs at least one bound"),
        ({"rollout_importance_sampling_clip_min": 2.0, "rollout_importance_sampling_clip_max": 1.0}, "must be less"),
        ({"sampler_check_threshold": 0.0}, "sampler_check_threshold=0.0"),
        ({"rollout_engine": "no.such.Engine"}, "rollout_engine"),
        ({"rollout_engine_options": {"threads": 1}}, "without rollout_engine"),
    ],
)  # fmt: skip
def test_bad_engine_and_correction_options_are_refused_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        RLOOModule("tiny", reward_funcs=[length_reward], **options)


@pytest.mark.parametrize("correction", [True, False])
def test_an_engine_with_its_own_numerics_is_checked_and_corrected_per_sequence(tmp_path, correction):
    with pytest.warns(UserWarning, match="ShiftedEngine's log-probs differ from the trainer's"):
        module, log = _fit(tmp_path, rollout_importance_sampling_correction=correction)
    gaps = log[["sampler_check/logp_gap_mean", "sampler_check/logp_gap_max"]].dropna()
    assert len(gaps) == 2 and ((gaps - SHIFT).abs() < ROUNDING).all().all(), gaps  # every round, the engine's gap
    lengths_seen = set()
    for loss, rows, batch in module.seen:
        lengths = rows["completion_mask"].sum(1)
        lengths_seen.update(lengths.tolist())
        rho = torch.exp(SHIFT * lengths)
        rho = torch.where(rho > 3.0, torch.zeros_like(rho), rho) if correction else torch.ones_like(rho)
        # on-policy (one round per optimizer step) every policy ratio is 1: the loss is mean_i(-rho_i A_i)
        expected = (-rho * rows["advantages"]).mean()
        assert loss.item() == pytest.approx(expected.item(), rel=ROUNDING, abs=1e-6)
        assert ("sampling_logps" in batch) is correction
    assert len(module.seen) == 2 and {4.0} < lengths_seen  # masked full-length rows beside shorter ones
    if correction:
        ratio_max = log["sampling/importance_sampling_ratio/max"].dropna()
        assert len(ratio_max) == 2 and (ratio_max <= 3.0).all() and (ratio_max >= math.exp(SHIFT) - ROUNDING).all()
        assert (log["sampling/importance_sampling_ratio/min"].dropna() == 0.0).all()  # a full-length row is masked
        difference = log["sampling/sampling_logp_difference/mean"].dropna()
        assert ((difference - SHIFT).abs() < ROUNDING).all()
    else:
        assert "sampling/importance_sampling_ratio/max" not in log


def test_rounds_of_generate_carry_no_engine_terms(tmp_path):
    module, log = _fit(tmp_path, steps=1, rollout_engine=None)
    assert not [c for c in log.columns if c.startswith(("sampler_check/", "sampling/"))]
    assert all("sampling_logps" not in batch for _, _, batch in module.seen)


def test_synchronous_grpo_rounds_of_such_an_engine_are_checked_and_corrected(tmp_path):
    L.seed_everything(0)
    module = grpo(rollout_engine=f"{__name__}.ShiftedEngine")  # max_staleness None: sampled in this process
    logger = CSVLogger(tmp_path, name="log")
    trainer = L.Trainer(max_steps=2, log_every_n_steps=1, **{**QUIET, "logger": logger})
    with pytest.warns(UserWarning, match="ShiftedEngine's log-probs differ from the trainer's"):
        trainer.fit(module, datamodule=data(n=8, batch_size=8))
    log = pd.read_csv(f"{logger.log_dir}/metrics.csv")
    gaps = log[["sampler_check/logp_gap_mean", "sampler_check/logp_gap_max"]].dropna()
    assert len(gaps) == 2 and ((gaps - SHIFT).abs() < ROUNDING).all().all(), gaps
    difference = log["sampling/sampling_logp_difference/mean"].dropna()
    assert len(difference) == 2 and ((difference - SHIFT).abs() < ROUNDING).all()
    ratio_max = log["sampling/importance_sampling_ratio/max"].dropna()  # GRPO's default mode: sequence_mask, 3.0
    assert (ratio_max <= 3.0).all() and (ratio_max >= math.exp(SHIFT) - ROUNDING).all()
    assert not [c for c in log.columns if c.startswith("async/")]
