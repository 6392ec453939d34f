"""2-rank DDP DPO and GRPO with images (``tiny-vl``) equal one process: see ``tests/scripts/ddp_vision_rl.py`` for the
geometry and what each rank records. The references are written out pair by pair / row by row here (each row run
alone with its own picture, no padding), so they share no code with the modules' batched losses."""

from __future__ import annotations

import copy
from typing import Any

import ddp_vision_rl as script  # tests/scripts: constants and helpers; nothing runs on import
import pytest
import torch
import torch.nn.functional as F
from ddp_vision import vision_model  # tests/scripts

from helpers.accumulation import calibrated
from lit_trainer.data.vision.prompt import ROW_IMAGES, model_image_inputs

TOWER = "model.vision_tower."


def _trainable_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradient of every weight but the (frozen by default) vision tower's, zeros where none flowed."""
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
        if not n.startswith(TOWER)
    }


def _completion_logp(model: torch.nn.Module, ids: torch.Tensor, scored: torch.Tensor, pixels: torch.Tensor):
    """Sum of log p(token) over the positions of ``scored`` of ONE unpadded row with its own picture(s)."""
    dtype = next(model.parameters()).dtype
    logits = model(input_ids=ids.unsqueeze(0), pixel_values=pixels.to(dtype)).logits[0, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
    return (logp * scored[1:].to(logp.dtype)).sum()


def _pairs(micro_batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each pair of some DPO micro-batches (chosen rows first, then rejected; one picture per pair, given twice),
    unpadded: chosen and rejected ids, their completion masks, the pair's picture."""
    out = []
    for batch in micro_batches:
        n = batch["input_ids"].shape[0] // 2
        for i in range(n):
            pair = {"pixels": batch["pixel_values"][i : i + 1]}
            assert torch.equal(batch["pixel_values"][i], batch["pixel_values"][n + i])
            for side, row in (("chosen", i), ("rejected", n + i)):
                keep = batch["attention_mask"][row].bool()
                pair[side] = batch["input_ids"][row][keep]
                pair[side + "_mask"] = batch["completion_mask"][row][keep]
            out.append(pair)
    return out


def _dpo_gradient(model: torch.nn.Module, pairs: list[dict], lose_a_pair: bool = False) -> dict[str, torch.Tensor]:
    """Sigmoid DPO over all ``pairs`` (mean over pairs), at the initial weights where the reference IS the policy:
    ``-log sigmoid(beta * ((c - sg(c)) - (r - sg(r))))`` with ``c``/``r`` the summed completion log-probs."""
    model.zero_grad()
    pairs = pairs[1:] if lose_a_pair else pairs
    loss = 0.0
    for p in pairs:
        chosen = _completion_logp(model, p["chosen"], p["chosen_mask"], p["pixels"])
        rejected = _completion_logp(model, p["rejected"], p["rejected_mask"], p["pixels"])
        margin = (chosen - chosen.detach()) - (rejected - rejected.detach())
        loss = loss - F.logsigmoid(script.DPO_BETA * margin) / len(pairs)
    loss.backward()
    return _trainable_grads(model)


def _grpo_gradient(model: torch.nn.Module, slices: list[dict], lose_a_row: bool = False) -> dict[str, torch.Tensor]:
    """On-policy dapo GRPO written out row by row (temperature 1, beta 0): per kept token ``-A * exp(lp - sg(lp))``,
    summed over the step's rows and divided by the step's kept tokens; each row with its own picture."""
    model.zero_grad()
    rows = []
    for s in slices:
        for i in range(s["advantages"].shape[0]):
            images = model_image_inputs({k: v[i : i + 1] for k, v in s.items() if k.startswith(ROW_IMAGES)})
            prompt, kept = (
                s["prompt_ids"][i][s["prompt_mask"][i].bool()],
                s["completion_ids"][i][s["completion_mask"][i].bool()],
            )
            rows.append((prompt, kept, images["pixel_values"], s["advantages"][i]))
    if lose_a_row:
        rows.pop(next(i for i, r in enumerate(rows) if r[1].numel() and r[3] != 0))
    total = sum(r[1].numel() for r in rows)
    loss = 0.0
    for prompt, kept, pixels, advantage in rows:
        if not kept.numel():
            continue
        ids = torch.cat([prompt, kept])
        scored = torch.cat([torch.zeros_like(prompt), torch.ones_like(kept)])
        dtype = next(model.parameters()).dtype
        logits = model(input_ids=ids.unsqueeze(0), pixel_values=pixels.to(dtype)).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)[scored[1:].bool()]
        loss = loss + (-advantage.to(dtype) * torch.exp(lp - lp.detach())).sum() / total
    loss.backward()
    return _trainable_grads(model)


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_dpo_and_grpo_with_images_equal_one_process(ddp_world) -> None:
    out = ddp_world.part("vision_rl")  # tests/scripts/ddp_vision_rl.py, run in the shared 2-rank world
    model = vision_model(0)  # the initial weights of both runs

    # ---------------------------------------------------------------------------------------------------- DPO
    dpo = [torch.load(out / f"dpo_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [len(d["seen"]) for d in dpo] == [4, 4] and [len(d["grads"]) for d in dpo] == [2, 2]
    everything = [p["pixels"] for d in dpo for p in _pairs(d["seen"])]
    # the ranks trained on different pairs: 16 distinct pictures in all (the pictures tell the pairs apart)
    assert len(everything) == script.PAIRS
    assert all(not torch.equal(a, b) for i, a in enumerate(everything) for b in everything[i + 1 :])
    for step in (0, 1):
        # optimizer step k used micro-batches 2k and 2k+1 of each rank: 8 pairs, 4 per rank
        pairs = [p for d in dpo for p in _pairs(d["seen"][2 * step : 2 * step + 2])]
        # tolerance: the reference's float32 rounding against its float64 twin (helpers/accumulation.calibrated),
        # bound 4 x that scale; a real mistake, a pair lost at a rank or window boundary, must lie 10 bounds beyond.
        # Measured: scale 1.0e-6, bound 4.2e-6, the ranks' gradients 4.8e-7 (step 1) and 6.2e-7 (step 2) from the
        # reference, the lost pair 5.8e-1 / 7.2e-1 (relative L2)
        reference = calibrated(
            lambda m, p=pairs: _dpo_gradient(m, p),
            model,
            mistake=lambda m, p=pairs: _dpo_gradient(m, p, lose_a_pair=True),
            what=f"DDP vision DPO gradient, step {step + 1}",
        )
        for d in dpo:
            got = d["grads"][step]
            assert not any(n.startswith(TOWER) for n in got)  # the frozen tower has no gradient
            reference.check(got)

    # --------------------------------------------------------------------------------------------------- GRPO
    grpo = [torch.load(out / f"grpo_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [g["global_step"] for g in grpo] == [2, 2]
    slices = [s for g in grpo for s in g["step0"]["slices"][: script.ACCUMULATE]]
    assert all(s["advantages"].shape[0] == script.BATCH for s in slices)
    assert all(s[ROW_IMAGES + "pixel_values.count"].tolist() == [1] * script.BATCH for s in slices)
    assert torch.cat([s["advantages"] for s in slices]).abs().sum() > 0  # a signal: the step is not trivially 0
    pictures = [s[ROW_IMAGES + "pixel_values"][:, 0] for s in slices]
    rank_pictures = [torch.cat(pictures[:2]), torch.cat(pictures[2:])]
    assert not any(torch.equal(a, b) for a in rank_pictures[0] for b in rank_pictures[1])  # each rank its own prompts
    # tolerance calibrated as for DPO. Measured: scale 5.5e-7, bound 2.2e-6, the ranks' step gradient 3.0e-7 from the
    # reference, a lost row 4.5e-1
    reference = calibrated(
        lambda m: _grpo_gradient(m, slices),
        model,
        mistake=lambda m: _grpo_gradient(m, slices, lose_a_row=True),
        what="DDP vision GRPO step gradient",
    )
    for g in grpo:
        got: dict[str, Any] = {n: t for n, t in g["step0"]["grads"].items() if not n.startswith(TOWER)}
        assert not any(n.startswith(TOWER) for n in g["step0"]["grads"])
        reference.check(got)
    # DDP keeps the replicas identical: the same all-reduced gradients, the same two optimizer steps
    initial = dict(copy.deepcopy(model).named_parameters())
    changed = 0
    for name, weight in grpo[0]["weights"].items():
        assert torch.equal(weight, grpo[1]["weights"][name]), name
        changed += not torch.equal(weight, initial[name])
    assert changed > 0
