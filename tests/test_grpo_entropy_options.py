"""GRPO's entropy and off-policy options against hand-checked values and against TRL 1.16's own loss code:
``top_entropy_quantile``, ``off_policy_mask_threshold``, ``entropy_coef`` and the adaptive entropy schedule."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.trl_grpo import reference_loss, reference_trainer
from lit_trainer.losses.grpo import grpo_policy_loss
from lit_trainer.losses.grpo_masks import high_entropy_mask, masked_mean_entropy, off_policy_mask
from lit_trainer.modules.grpo._entropy import EntropyControl, adaptive_entropy_coef, gather_entropy_pool

# float64 inputs throughout: ours and the reference evaluate the same formulas in a different order, so they agree to
# a few float64 units (1e-12 relative is ~5000 units: far below any real difference, which is O(1e-2) here)
F64 = {"rtol": 1e-12, "atol": 1e-12}


def _batch(seed: int = 0, rows: int = 4, length: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    return {
        "logps": (-torch.rand(rows, length, generator=g, dtype=torch.float64) * 3).requires_grad_(),
        "entropies": (torch.rand(rows, length, generator=g, dtype=torch.float64) * 2).requires_grad_(),
        "old": -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3,
        "ref": -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3,
        "mask": mask,
        "adv": torch.tensor([1.0, -0.5, -1.0, 0.0], dtype=torch.float64)[:rows],  # 0: a zero-spread group
    }


# --------------------------------------------------------------------------------------------------- masks
def test_high_entropy_mask_by_hand():
    e = torch.tensor([[0.1, 0.5, 0.9, 7.0], [0.3, 0.7, 0.2, 0.4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # kept entropies 0.1 0.5 0.9 0.3 0.7: the 0.6-quantile (rho = 0.4) interpolates 0.5 -> 0.7 at 0.4: 0.58
    kept = high_entropy_mask(e, mask, e[mask.bool()], 0.6)
    assert kept.tolist() == [[False, False, True, False], [False, True, False, False]]  # 7.0 is padding
    assert high_entropy_mask(e, mask, e[mask.bool()], 0.0).sum() == 5  # rho = 1: every kept token
    assert high_entropy_mask(e, mask, e[mask.bool()], 1.0).tolist() == [[False, False, True, False], [False] * 4]
    assert not high_entropy_mask(e, mask, torch.empty(0), 0.5).any()
    # the pool decides the threshold: another rank's larger entropies raise it
    assert not high_entropy_mask(e, mask, torch.tensor([5.0, 6.0]), 0.5).any()


def test_entropy_pool_gathers_every_rank_without_the_padding():
    e = torch.tensor([[0.5, 0.25, 9.0]])
    mask = torch.tensor([[1, 1, 0]])

    def two_ranks(x):  # the other rank holds 3 tokens (1.0, 2.0, 3.0), so this rank pads its 2 to 3
        other = torch.tensor([3]) if x.numel() == 1 else torch.tensor([1.0, 2.0, 3.0])
        return torch.stack([x.float().reshape(-1)[: other.numel()] if x.numel() == 1 else x, other.float()])

    pool = gather_entropy_pool(e, mask, 2, two_ranks)
    assert sorted(pool.tolist()) == [0.25, 0.5, 1.0, 2.0, 3.0]
    assert gather_entropy_pool(e, mask, 1, two_ranks).tolist() == [0.5, 0.25]


def test_off_policy_mask_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    old = torch.zeros(3, 3)
    logps = torch.log(torch.tensor([[0.5, 0.5, 0.01], [0.9, 0.9, 0.9], [0.1, 1.0, 1.0]]))
    # mean(old - logp): row 0 ln 2 = 0.69 (padding ignored), row 1 0.105, row 2 ln 10 = 2.3
    keep = off_policy_mask(torch.tensor([-1.0, -1.0, 2.0]), logps, old, mask, 0.5)
    assert keep.tolist() == [[0.0], [1.0], [1.0]]  # dropped: negative advantage AND mean > 0.5
    assert off_policy_mask(torch.tensor([-1.0, -1.0, -1.0]), logps, old, mask, 3.0).tolist() == [[1.0]] * 3
    assert off_policy_mask(torch.tensor([0.0]), logps[:1], old[:1], mask[:1], 0.5).tolist() == [[1.0]]  # A >= 0
    on_policy = off_policy_mask(-torch.ones(3), logps, logps.detach(), mask, 0.0)  # old = logp: kl = 0 <= 0
    assert on_policy.tolist() == [[1.0]] * 3
    assert masked_mean_entropy(torch.tensor([[1.0, 3.0, 7.0]]), torch.tensor([[1, 1, 0]])) == 2.0


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5])
def test_high_entropy_mask_equals_the_reference(rho):
    b = _batch(1)
    fake = reference_trainer()
    expected = fake.get_high_entropy_mask(b["entropies"].detach(), b["mask"], 1 - rho)
    e = b["entropies"].detach()
    ours = high_entropy_mask(e, b["mask"], e[b["mask"].bool()], 1 - rho)
    assert torch.equal(ours, expected)
    assert 0 < int(ours.sum()) < int(b["mask"].sum())


def test_off_policy_mask_equals_the_reference():
    b = _batch(2)
    for threshold in (-0.5, 0.0, 0.3, 1.0):
        expected = reference_trainer().get_off_policy_mask(
            advantages=b["adv"].unsqueeze(1),
            per_token_logps=b["logps"],
            sampling_per_token_logps=b["old"],
            mask=b["mask"],
            off_policy_threshold=threshold,
        )
        ours = off_policy_mask(b["adv"], b["logps"], b["old"], b["mask"], threshold)
        assert torch.equal(ours, expected.to(ours.dtype)), threshold


# ------------------------------------------------------------------------------------ loss with the options
def _ours(b, *, loss_type, rho, threshold, coef, old=True, beta=0.0, epsilon_high=None):
    e, mask = b["entropies"], b["mask"]
    old_logps = b["old"] if old else None
    masks, entropy_mask = [], None
    if rho < 1.0:
        entropy_mask = high_entropy_mask(e.detach(), mask, e.detach()[mask.bool()], 1 - rho).to(mask.dtype)
        masks.append(entropy_mask)
    if threshold is not None:
        reference = b["logps"].detach() if old_logps is None else old_logps
        masks.append(off_policy_mask(b["adv"], b["logps"], reference, mask, threshold))
    policy_mask = math.prod(masks) if masks else None
    policy = grpo_policy_loss(
        b["logps"], old_logps, b["adv"], mask, loss_type=loss_type, num_items_in_batch=mask.sum(),
        policy_mask=policy_mask, beta=beta, ref_logps=b["ref"] if beta else None, max_completion_length=8,
        epsilon_high=epsilon_high,
    )  # fmt: skip
    bonus = masked_mean_entropy(e, mask if entropy_mask is None else mask * entropy_mask)
    return policy - coef * bonus


@pytest.mark.parametrize(
    ("loss_type", "rho", "threshold", "coef", "old", "beta"),
    [
        ("dapo", 0.2, None, 0.0, True, 0.0),
        ("grpo", 1.0, 0.3, 0.0, True, 0.1),
        ("dapo", 0.5, 0.3, 0.05, True, 0.1),
        ("bnpo", 1.0, 0.0, 0.1, False, 0.0),
        ("cispo", 0.3, 0.2, 0.02, True, 0.0),
        ("luspo", 0.4, None, 0.1, True, 0.04),
    ],
)
def test_loss_and_gradients_equal_the_reference(loss_type, rho, threshold, coef, old, beta):
    b = _batch(3)
    epsilon_high = 5.0 if loss_type == "cispo" else None  # the cispo cap (TRL's suggested value)
    fake = reference_trainer(
        loss_type=loss_type, top_entropy_quantile=rho, entropy_coef=coef, off_policy_mask_threshold=threshold,
        beta=beta, epsilon_high=epsilon_high,
    )  # fmt: skip
    expected = reference_loss(
        fake, b["logps"], b["entropies"], b["mask"], b["adv"], old_logps=b["old"] if old else None, ref_logps=b["ref"]
    )
    grads = torch.autograd.grad(expected, [b["logps"], b["entropies"]], allow_unused=True)
    ours = _ours(
        b, loss_type=loss_type, rho=rho, threshold=threshold, coef=coef, old=old, beta=beta, epsilon_high=epsilon_high
    )
    torch.testing.assert_close(ours, expected, **F64)
    ours_grads = torch.autograd.grad(ours, [b["logps"], b["entropies"]], allow_unused=True)
    for mine, theirs in zip(ours_grads, grads):
        if theirs is None:
            assert mine is None or not mine.any()
        else:
            torch.testing.assert_close(mine, theirs, **F64)
    if coef:
        assert fake._metrics["train"]["policy_loss"]  # the reference logs policy_loss with the bonus on, as we do


def test_masks_change_the_loss():
    """The comparison above can fail: without the masks our loss differs from the reference's."""
    b = _batch(3)
    fake = reference_trainer(loss_type="dapo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.0)
    expected = reference_loss(fake, b["logps"], b["entropies"], b["mask"], b["adv"], old_logps=b["old"])
    plain = grpo_policy_loss(b["logps"], b["old"], b["adv"], b["mask"], num_items_in_batch=b["mask"].sum())
    assert abs(float((plain - expected).detach())) > 1e-3


# ------------------------------------------------------------------------------------------ adaptive schedule
def test_adaptive_coefficient_by_hand():
    step = {"target": 0.2, "delta": 0.005, "coef_min": 0.0, "coef_max": 0.012}
    assert adaptive_entropy_coef(0.01, 0.2, **step) == pytest.approx(0.012)  # at the target: up (capped at max)
    assert adaptive_entropy_coef(0.01, 0.1, **step) == 0.012
    assert adaptive_entropy_coef(0.01, 0.3, **step) == pytest.approx(0.005)
    assert adaptive_entropy_coef(0.002, 0.3, **step) == 0.0  # clamped at min


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_adaptive_entropy_trajectory_equals_the_reference(loss_type):
    """Four optimizer steps of two micro-steps: the applied coefficient, its updates, the last measured entropy and
    every micro-step's loss and gradient equal TRL's ``_compute_loss`` run with the same accumulation."""
    accumulate, target = 2, 0.8
    options = {"entropy_target": target, "entropy_coef_delta": 0.05, "entropy_coef_min": 0.01, "entropy_coef_max": 0.12}
    fake = reference_trainer(
        loss_type=loss_type, entropy_coef=0.1, use_adaptive_entropy=True, gradient_accumulation_steps=accumulate,
        steps_per_generation=accumulate, **options,
    )  # fmt: skip
    control = EntropyControl(0.1, True, target, 0.05, 0.01, 0.12)
    applied = []
    for step in range(4):
        # entropies around 0.5 (below the target) in steps 0-1, around 1.5 (above) in steps 2-3
        batches = [_batch(10 * step + i) for i in range(accumulate)]
        for b in batches:
            b["entropies"] = (b["entropies"].detach() * 0.5 + (0.0 if step < 2 else 1.0)).requires_grad_()
        tokens = sum(b["mask"].sum() for b in batches)
        for i, b in enumerate(batches):
            ends = i == accumulate - 1
            expected = reference_loss(
                fake, b["logps"], b["entropies"], b["mask"], b["adv"], num_items_in_batch=tokens, step_ends=ends
            )
            policy = grpo_policy_loss(
                b["logps"], None, b["adv"], b["mask"], loss_type=loss_type, num_items_in_batch=tokens
            )
            contribution = policy if loss_type == "dapo" else policy / accumulate  # the module's share (W = 1)
            control.observe(b["entropies"], b["mask"])
            applied.append(control.applied_coef())
            ours = contribution + control.take_bonus(accumulate)
            if ends:
                control.end_step(lambda t: t)
            torch.testing.assert_close(ours, expected, **F64)
            for mine, theirs in zip(
                torch.autograd.grad(ours, [b["logps"], b["entropies"]]),
                torch.autograd.grad(expected, [b["logps"], b["entropies"]]),
            ):
                torch.testing.assert_close(mine, theirs, **F64)
        assert control.coef == pytest.approx(fake.entropy_coef, rel=1e-12)
        assert control.last_entropy == pytest.approx(fake._last_world_entropy, rel=1e-12)
    # step 0: no measurement yet (no bonus); 1: entropy <= target, coef 0.1 -> 0.12 -> applied; 2: still the step-1
    # measurement (below) -> applied 0.12; 3: step 2 measured above the target -> not applied
    assert applied[::2] == [0.0, pytest.approx(0.12), pytest.approx(0.12), 0.0]
    assert fake._metrics["train"]["entropy_coef"] == pytest.approx([0.12, 0.12, 0.07, 0.02])


def test_entropy_control_state_round_trips():
    control = EntropyControl(0.1, True, 0.8, 0.05, 0.0, 1.0)
    control.observe(torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 0]]))
    state = control.state_dict()
    assert state == {"coef": 0.1, "last_entropy": math.inf, "window": state["window"]}
    assert state["window"].tolist() == [1.0, 1.0]
    other = EntropyControl(0.5, True, 0.8, 0.05, 0.0, 1.0)
    other.load_state_dict(state, torch.device("cpu"))
    assert other.coef == 0.1 and other.last_entropy == math.inf and torch.equal(other.window, control.window)
