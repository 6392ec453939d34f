"""2-process DDP GRPO with top_entropy_quantile, the adaptive entropy bonus, sync_ref_model and log_completions: see
``tests/scripts/ddp_grpo_options.py`` for the geometry and what is recorded."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import ddp_grpo_options as script  # tests/scripts: constants and helpers; nothing runs on import
import pytest
import torch

from helpers.accumulation import calibrated

pytestmark = pytest.mark.ddp


@pytest.fixture(scope="module")
def run(ddp_world) -> Path:
    return ddp_world.part("grpo_options")  # tests/scripts/ddp_grpo_options.py


def _ranks(run: Path, phase: str) -> list[dict]:
    return [torch.load(run / f"{phase}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def _rows(s: dict) -> list[dict]:
    return [{k: v[i] for k, v in s.items()} for i in range(s["advantages"].shape[0])]


def step_gradient(model: Any, micro_steps: list[list[dict]], rho: float, coef: float) -> dict:
    """One optimizer step over ranks written out row by row. ``micro_steps[k]`` = every rank's k-th micro-batch. Per
    micro-step the entropy threshold is the ``1 - rho`` quantile of the kept tokens of all ranks' micro-batches; a
    token at or above it trains ``-min(r A, clip(r, 0.8, 1.2) A)`` (r = exp(lp - old)); every token adds the
    bias-corrected k3 KL ``0.1 k3 r``; all summed / the step's tokens over ranks; minus ``coef`` times each rank's
    micro-batch mean entropy of its trained tokens, averaged over micro-steps and ranks."""
    model.zero_grad()
    tokens = sum(int(s["completion_mask"].sum()) for micro in micro_steps for s in micro)
    shares = sum(len(micro) for micro in micro_steps)
    loss = 0.0
    for micro in micro_steps:
        terms = []
        for s in micro:
            for row in _rows(s):
                prompt, kept = row["prompt_ids"][row["prompt_mask"].bool()], row["completion_mask"].bool()
                ids = torch.cat([prompt, row["completion_ids"][kept]]).unsqueeze(0)
                lp_all = torch.log_softmax(model(input_ids=ids).logits[0, prompt.numel() - 1 : -1], -1)
                lp = lp_all.gather(-1, row["completion_ids"][kept].unsqueeze(-1)).squeeze(-1)
                terms.append((row, kept, lp, -(lp_all.exp() * lp_all).sum(-1)))
        pool = torch.cat([h.detach() for *_, h in terms])
        threshold = torch.quantile(pool, 1 - rho)  # in the twin's dtype
        per_rank = len(terms) // len(micro)
        for r in range(len(micro)):
            kept_entropy, kept_count = 0.0, 0
            for row, kept, lp, h in terms[r * per_rank : (r + 1) * per_rank]:
                keep = (h.detach() >= threshold).to(lp.dtype)
                old, ref = row["old_logps"][kept].to(lp.dtype), row["ref_logps"][kept].to(lp.dtype)
                a = row["advantages"]
                ratio = torch.exp(lp - old)
                policy = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) * keep
                kl = 0.1 * (torch.exp(ref - lp) - (ref - lp) - 1) * ratio
                loss = loss + (policy + kl).sum() / tokens
                kept_entropy, kept_count = kept_entropy + (h * keep).sum(), kept_count + int(keep.sum())
            loss = loss - coef * kept_entropy / max(1, kept_count) / shares
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("step", [0, 1])
def test_synced_step_gradient_equals_the_written_out_one(run: Path, step: int):
    ranks = _ranks(run, "full")
    recorded = [t["steps"][step] for t in ranks]
    # step 0: no entropy measured yet, no bonus; step 1: entropy <= 100 at step 0, so 0.05 + 0.1 applies
    assert [r["coef"] for r in recorded] == ([0.0, 0.0] if step == 0 else [pytest.approx(0.15)] * 2)
    micro_steps = [[r["slices"][2 * step + k] for r in recorded] for k in range(2)]  # step s serves slices 2s, 2s+1
    assert all("old_logps" in s and "ref_logps" in s for micro in micro_steps for s in micro)
    model = script.build_model()
    model.load_state_dict(recorded[0]["model"])
    coef = recorded[0]["coef"]
    reference = calibrated(
        lambda m: step_gradient(m, micro_steps, 0.5, coef),
        model,
        # a real mistake: each rank thresholding its own entropies (step 0), or the bonus left out (step 1)
        mistake=(lambda m: step_gradient(m, [[s] for micro in micro_steps for s in micro], 0.5, coef))
        if step == 0
        else (lambda m: step_gradient(m, micro_steps, 0.5, 0.0)),
        what=f"DDP step-{step} gradient",
    )
    for r in recorded:
        reference.check(r["grads"])


def test_entropy_state_and_synced_reference_resume_exactly(run: Path):
    full, resumed = _ranks(run, "full"), _ranks(run, "resumed")
    for f, g in zip(full, resumed):
        assert g["global_step"] == 4
        assert f["entropy"]["coef"] == pytest.approx(0.45) and f["entropy"]["coef"] == g["entropy"]["coef"]
        assert f["entropy"]["last_entropy"] == g["entropy"]["last_entropy"]
        for key in ("weights", "ref"):
            for name in f[key]:
                assert torch.equal(f[key][name], g[key][name]), (key, name)
    assert full[0]["entropy"] == full[1]["entropy"]  # every rank moves the coefficient with the all-reduced entropy
    # the reference moved with the policy (synced every step) and stays the same on both ranks
    assert any(not torch.equal(full[0]["ref"][n], script.build_model().state_dict()[n]) for n in full[0]["ref"])
    assert all(torch.equal(full[0]["ref"][n], full[1]["ref"][n]) for n in full[0]["ref"])


def test_completions_table_has_every_ranks_rows(run: Path):
    path = next((run / "full").rglob("completions.csv"))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    # 4 logging steps x the generation batch of 24 rows (12 per rank): 3 prompts x 8
    assert len(rows) == 4 * 24 and [r["step"] for r in rows[::24]] == ["0", "1", "2", "3"]
    prompts = script.prompt_texts()
    assert [r["prompt"] for r in rows[:24]] == [p for p in prompts[:3] for _ in range(8)]
    assert [r["prompt"] for r in rows[48:72]] == [p for p in prompts[3:6] for _ in range(8)]
