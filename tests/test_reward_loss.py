"""reward_loss / reward_metrics on small tensors checked by hand (log σ values from math, not from the code)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_trainer.losses import reward_loss
from lit_trainer.losses.reward import reward_metrics


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_bradley_terry_per_pair():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    expected = [-_log_sigmoid(1.0), math.log(2.0), -_log_sigmoid(-2.0)]  # 0.3133, 0.6931, 2.1269
    assert reward_loss(chosen, rejected).tolist() == pytest.approx(expected, rel=1e-6)


def test_margin_is_subtracted_inside_the_sigmoid():
    chosen, rejected, margin = torch.tensor([2.0, 3.0]), torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.5])
    expected = [math.log(2.0), -_log_sigmoid(2.5)]  # the first pair just meets its margin: log 2
    assert reward_loss(chosen, rejected, margin=margin).tolist() == pytest.approx(expected, rel=1e-6)


def test_centring_term_adds_c_times_the_squared_sum():
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([1.0, -1.0])
    c = 0.01
    expected = [-_log_sigmoid(1.0) + c * 9.0, math.log(2.0) + c * 4.0]
    got = reward_loss(chosen, rejected, center_rewards_coefficient=c)
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    # the mean is TRL's form: mean of the BT terms + c * mean of the squares
    trl_form = (math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2 + c * (9.0 + 4.0) / 2
    assert got.mean().item() == pytest.approx(trl_form, rel=1e-6)


def test_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    reward_loss(chosen, rejected).sum().backward()
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)  # −σ(0), +σ(0)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="one value per pair"):
        reward_loss(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="one value per pair"):
        reward_loss(torch.zeros(2), torch.zeros(2), margin=torch.zeros(1))


def test_metrics_by_hand():
    m = reward_metrics(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, -3.0]))
    assert m["accuracy"].item() == pytest.approx(2 / 3)  # the tie counts as wrong
    assert m["margin"].item() == pytest.approx((1.0 + 0.0 + 4.0) / 3)
    assert m["mean_reward"].item() == pytest.approx(1.0 / 6)
    assert (m["min_reward"].item(), m["max_reward"].item()) == (-3.0, 2.0)
    assert m["chosen_reward"].item() == pytest.approx(1.0) and m["rejected_reward"].item() == pytest.approx(-2 / 3)
