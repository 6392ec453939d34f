"""TRL 1.16's own GRPO loss code run on given tensors: ``GRPOTrainer._compute_loss`` on a stand-in trainer object.

The stand-in supplies only what ``_compute_loss`` reads (the options, a one-process accelerator, the metrics dict) and
returns the given per-token log-probs and entropies instead of running a model, so the reference's masks, entropy bonus
and adaptive entropy controller can be compared with ours on hand-made tensors. Tests only: the library never
imports trl.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402


class OneProcess:
    """The accelerator calls ``_compute_loss`` makes, for one process; ``sync_gradients`` marks a step's end."""

    num_processes = 1

    def __init__(self) -> None:
        self.sync_gradients = True

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: Any = 0) -> torch.Tensor:
        return tensor


def reference_trainer(
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    use_adaptive_entropy: bool = False,
    off_policy_mask_threshold: float | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    **args: Any,
) -> Any:
    """A stand-in ``GRPOTrainer`` with these options (``args``: entropy_target, entropy_coef_delta, ...)."""
    fake = types.SimpleNamespace()
    defaults = {
        "delta": None, "use_bias_correction_kl": True, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
        "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
        "entropy_target": 0.2, "entropy_coef_delta": 0.005, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0,
    }  # fmt: skip
    fake.args = types.SimpleNamespace(**{**defaults, **args, "steps_per_generation": steps_per_generation})
    fake.loss_type, fake.beta, fake.epsilon_low = loss_type, beta, epsilon
    fake.epsilon_high = epsilon if epsilon_high is None else epsilon_high
    fake.importance_sampling_level, fake.max_completion_length = "token", 8
    fake.top_entropy_quantile, fake.off_policy_mask_threshold = top_entropy_quantile, off_policy_mask_threshold
    fake.entropy_coef, fake.use_adaptive_entropy = entropy_coef, use_adaptive_entropy
    fake._entropy_bonus_enabled = entropy_coef != 0.0 or use_adaptive_entropy
    fake._last_world_entropy, fake._entropy_window_stats = float("inf"), None
    fake.use_vllm, fake.vllm_importance_sampling_correction, fake.aux_loss_enabled = False, False, False
    fake.current_gradient_accumulation_steps = gradient_accumulation_steps
    fake.accelerator = OneProcess()
    fake.model = types.SimpleNamespace(training=True)
    fake._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    fake.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, fake)
    fake.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    fake.get_gamma_weights = GRPOTrainer.get_gamma_weights
    return fake


def reference_loss(
    fake: Any,
    logps: torch.Tensor,
    entropies: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | None = None,
    step_ends: bool = True,
) -> torch.Tensor:
    """``GRPOTrainer._compute_loss`` of one micro-batch whose model outputs are ``logps`` and ``entropies``."""
    rows, length = logps.shape
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    fake.accelerator.sync_gradients = step_ends
    inputs = {
        "prompt_ids": torch.ones(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.ones(rows, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum() if num_items_in_batch is None else num_items_in_batch,
    }
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    return GRPOTrainer._compute_loss(fake, fake.model, inputs)
