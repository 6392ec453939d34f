"""GRPOModule's ``off_policy_mask_threshold`` against TRL 1.16's ``GRPOTrainer._compute_loss``: on a round carrying
the sampler's log-probs (an asynchronous round with the importance-sampling correction; TRL's vLLM log-probs) the
sequence mask measures ``mean_t (sampler logp - logp)``, not ``old - logp`` (0 in a one-step round); on other rounds
it measures ``old - logp``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_grpo_module import grpo

from helpers.trl_grpo import reference_trainer
from lit_trainer.modules.online_rl._rollout_buffer import SAMPLING_LOGPS

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

THRESHOLD, CLIP_MAX = 0.1, 3.0
# mean (sampler - policy) log-prob per row: row 1 (A < 0) is dropped, rows 2 and 3 (A < 0) are kept; measured from
# the step's own log-probs instead (a one-step round) the mean is 0 for every row and nothing is dropped
OFFSETS = torch.tensor([[0.3], [0.3], [-0.3], [0.05]])
ADVANTAGES = torch.tensor([1.0, -0.5, -1.0, -0.7])
INPUTS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")


def _trl_ratio(old: torch.Tensor, samp: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio (``_generate_and_score_completions``, trl/trainer/grpo_trainer.py
    lines 2660-2707) with ``clip_min=None``, ``clip_max=CLIP_MAX``."""
    diff = torch.nan_to_num((old - samp) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    return ratio.clamp(max=CLIP_MAX) if mode.endswith("truncate") else ratio.masked_fill(ratio > CLIP_MAX, 0.0)


def _rows(module: Any, *, sampler: bool, stored_old: bool) -> dict[str, torch.Tensor]:
    """Four rows (two with padding); the sampler's log-probs (one NaN: a token it could not score) and/or stored old
    log-probs, both ``OFFSETS`` (+ noise) from the policy's."""
    g = torch.Generator().manual_seed(0)
    rows, prompt, length = 4, 3, 5
    batch = {
        "prompt_ids": torch.randint(3, 200, (rows, prompt), generator=g),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.randint(3, 200, (rows, length), generator=g),
        "completion_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0]]),
        "advantages": ADVANTAGES,
    }
    with torch.no_grad():
        logps = module.completion_logps(module.model, batch)[0]
    if sampler:
        batch[SAMPLING_LOGPS] = logps + OFFSETS + torch.randn(logps.shape, generator=g) * 0.05
        batch[SAMPLING_LOGPS][2, 1] = float("nan")
    if stored_old:  # a round spanning optimizer steps: old log-probs stored at its start
        batch["old_logps"] = logps + (0.02 if sampler else OFFSETS) + torch.randn(logps.shape, generator=g) * 0.01
    return batch


def _trl_loss(module: Any, batch: dict, loss_type: str, mode: str) -> torch.Tensor:
    """``GRPOTrainer._compute_loss`` on the module's own log-probs; with the sampler's log-probs, as a vLLM-corrected
    round (TRL then always stores old log-probs: in a one-step round they equal the step's own)."""
    logps, entropy = module.completion_logps(module.model, batch, with_entropy=True)
    mask, old = batch["completion_mask"], batch.get("old_logps")
    fake = reference_trainer(loss_type=loss_type, off_policy_mask_threshold=THRESHOLD)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropy, None)
    inputs = {**{k: batch[k] for k in INPUTS}, "num_items_in_batch": mask.sum()}
    if SAMPLING_LOGPS in batch:
        fake.use_vllm = fake.vllm_importance_sampling_correction = True
        old = logps.detach() if old is None else old
        inputs["sampling_per_token_logps"] = batch[SAMPLING_LOGPS]
        inputs["importance_sampling_ratio"] = _trl_ratio(old, batch[SAMPLING_LOGPS], mask, mode)
    if old is not None:
        inputs["old_per_token_logps"] = old
    return GRPOTrainer._compute_loss(fake, fake.model, inputs)


@pytest.mark.parametrize(
    ("loss_type", "mode", "sampler", "stored_old"),
    [
        ("dapo", "token_truncate", True, False),  # a stale one-step round: old = the step's own log-probs
        ("grpo", "sequence_mask", True, False),
        ("bnpo", "token_mask", True, True),  # old log-probs stored too: the sampler's still decide the mask
        ("dapo", "token_truncate", False, True),  # no sampler log-probs: measured from the stored old ones
    ],
)
def test_off_policy_mask_uses_the_sampler_logps_as_the_reference(loss_type, mode, sampler, stored_old):
    module = grpo(
        loss_type=loss_type, off_policy_mask_threshold=THRESHOLD, max_staleness=1,
        rollout_importance_sampling_mode=mode, rollout_importance_sampling_clip_max=CLIP_MAX,
    )  # fmt: skip
    module.train()
    batch = _rows(module, sampler=sampler, stored_old=stored_old)
    reference = batch[SAMPLING_LOGPS] if sampler else batch["old_logps"]
    with torch.no_grad():
        logps = module.completion_logps(module.model, batch)[0]
    kept = GRPOTrainer.get_off_policy_mask(ADVANTAGES[:, None], logps, reference, batch["completion_mask"], THRESHOLD)
    assert kept.flatten().tolist() == [1.0, 0.0, 1.0, 1.0]  # the mask does drop a row here
    params = [p for p in module.model.parameters() if p.requires_grad]
    expected = _trl_loss(module, batch, loss_type, mode)
    expected_grads = torch.autograd.grad(expected, params)
    ours, _ = module.compute_loss(batch, batch["completion_mask"].sum())
    grads = torch.autograd.grad(ours, params)
    # float32, the same log-probs and the same operations: measured equal bit for bit (loss and every gradient); the
    # bounds allow a few float32 units (~1.2e-7 each) for a reordered sum, far below the mask's effect on the loss
    # (0.05 to 0.35 here when the mask is measured from the wrong log-probs)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
