"""The GRPO loss options: one set of keywords for the loss and its metrics, unknown ones refused, same defaults."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from lit_trainer.losses.grpo import grpo_loss_metrics, grpo_policy_loss
from lit_trainer.losses.grpo_options import GRPO_LOSS_DEFAULTS, GRPOLossOptions
from lit_trainer.modules.grpo import GRPOModule


def _rows():
    logps = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.25, 0.25], [1.0, 0.5]], dtype=torch.float64))
    return logps, old, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2)


@pytest.mark.parametrize("function", [grpo_policy_loss, grpo_loss_metrics])
def test_unknown_option_is_refused_by_name(function) -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) epsilon_low: the options are loss_type, epsilon"):
        function(*_rows(), loss_type="grpo", epsilon_low=0.1)


def test_every_typed_option_has_a_default() -> None:
    assert set(GRPOLossOptions.__annotations__) == set(GRPO_LOSS_DEFAULTS)


def test_module_defaults_are_the_loss_defaults() -> None:
    parameters = inspect.signature(GRPOModule.__init__).parameters
    shared = set(parameters) & set(GRPO_LOSS_DEFAULTS)
    # every option of the loss but the per-batch tensors (and masks) is a GRPOModule argument, with the loss default
    per_batch = {"ref_logps", "num_items_in_batch", "policy_mask", "importance_sampling_ratio"}
    assert shared == set(GRPO_LOSS_DEFAULTS) - per_batch
    for name in shared - {"max_completion_length"}:  # the module's budget must be >= 1, the loss's is optional
        assert parameters[name].default == GRPO_LOSS_DEFAULTS[name], name


def test_metrics_take_the_vespo_shape_options() -> None:
    # one row, A = +1, ratios (2, 1) -> w = 2; with (k_pos, lambda_pos) = (1, 1): phi = 2 e^-1
    logps, old, _, _ = _rows()
    metrics = grpo_loss_metrics(
        logps[:1], old[:1], torch.ones(1), torch.ones(1, 2), loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=1.0
    )
    # tolerance: float64 inputs against the float64 hand formula
    assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(2 * math.exp(-1), rel=1e-12)


def test_metrics_need_no_dr_grpo_constant() -> None:
    assert set(grpo_loss_metrics(*_rows(), loss_type="dr_grpo")) >= {"clip_ratio/low_mean"}
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_policy_loss(*_rows(), loss_type="dr_grpo")
