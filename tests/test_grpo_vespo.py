"""GRPO ``loss_type="vespo"``: the gamma-weighted policy gradient, checked by hand on two rows."""

from __future__ import annotations

import math

import pytest
import torch

from lit_trainer.losses.grpo import grpo_loss_metrics, grpo_policy_loss, vespo_weights

# row 1: A = +1, ratios (2, 1) -> w = 2, (k, lambda) = (2, 3): phi = w^k e^(lambda (1 - w)) = 4 e^-3
# row 2: A = -1, ratios (1/2, 1) -> w = 1/2, (k, lambda) = (3, 2): phi = (1/2)^3 e^(2 * 1/2) = e / 8
PHI = (4 * math.exp(-3), math.e / 8)


def _rows():
    logps = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.25], [1.0, 0.5]], dtype=torch.float64))
    return logps, old, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2)


def test_vespo_weights_hand_checked():
    logps, old, advantages, mask = _rows()
    phi = vespo_weights(logps.detach() - old, mask, advantages)
    assert phi.flatten().tolist() == pytest.approx(PHI, rel=1e-12)
    assert vespo_weights(torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([-2.0])).item() == pytest.approx(1.0)


def test_vespo_loss_and_gradient_hand_checked():
    logps, old, advantages, mask = _rows()
    loss = grpo_policy_loss(logps, old, advantages, mask, loss_type="vespo")
    # -phi A logp per token, token mean over the 4 tokens; phi carries no gradient
    expected = (PHI[0] * 3 * math.log(2) - PHI[1] * 2 * math.log(2)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    grad = logps.grad.tolist()
    assert grad[0] == pytest.approx([-PHI[0] / 4] * 2, rel=1e-12)
    assert grad[1] == pytest.approx([PHI[1] / 4] * 2, rel=1e-12)
    # dapo-style normaliser: num_items_in_batch replaces the local token count
    halved = grpo_policy_loss(logps, old, advantages, mask, loss_type="vespo", num_items_in_batch=8)
    assert halved.item() == pytest.approx(expected / 2, rel=1e-12)
    metrics = grpo_loss_metrics(logps, old, advantages, mask, loss_type="vespo")
    assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(sum(PHI) / 2, rel=1e-12)


def test_vespo_masks_padding_and_refuses_sequence_level():
    logps, old, advantages, mask = _rows()
    padded = torch.cat([logps.detach(), torch.full((2, 1), -50.0, dtype=torch.float64)], dim=1)
    padded_old = torch.cat([old, torch.zeros(2, 1, dtype=torch.float64)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(2, 1)], dim=1)
    assert grpo_policy_loss(padded, padded_old, advantages, padded_mask, loss_type="vespo").item() == pytest.approx(
        (PHI[0] * 3 * math.log(2) - PHI[1] * 2 * math.log(2)) / 4, rel=1e-12
    )
    with pytest.raises(ValueError, match="does not apply to `loss_type='vespo'`"):
        grpo_policy_loss(logps, old, advantages, mask, loss_type="vespo", importance_sampling_level="sequence")


def test_grpo_module_trains_with_vespo_and_logs_phi():
    import lightning as L
    from test_grpo_module import QUIET, data, grpo

    module = grpo(loss_type="vespo", vespo_k_pos=1.5)
    logged: list[dict] = []
    module.log_dict = lambda values, *a, **k: logged.append(dict(values))  # type: ignore[method-assign]
    L.Trainer(max_steps=2, log_every_n_steps=1, **QUIET).fit(module, datamodule=data(12, batch_size=16))
    assert [round(float(v["vespo/phi_seq_mean"]), 6) for v in logged] == [1.0, 1.0]  # on-policy: w = 1, phi = 1
    assert all(math.isfinite(float(v["train_loss"])) for v in logged)
    with pytest.raises(ValueError, match="`importance_sampling_level` must be 'token'"):
        grpo(loss_type="vespo", importance_sampling_level="sequence")
