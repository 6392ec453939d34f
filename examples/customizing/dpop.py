"""A preference loss that needs the reference model: DPO-Positive (DPOP, Pal et al. 2024, "Smaug")."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_trainer import DPOModule
from lit_trainer.modules.dpo import Scores


def dpop_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    dpop_lambda: float,
) -> Tensor:
    """Per-pair ``−logσ(β(u_c − u_r − λ·max(0, −u_c)))`` with ``u = π − ρ`` (policy minus reference log-probs):
    sigmoid DPO plus a penalty when the chosen completion falls below the reference (``λ = 0``: sigmoid DPO)."""
    u_chosen = chosen_logps - ref_chosen_logps
    u_rejected = rejected_logps - ref_rejected_logps
    return -F.logsigmoid(beta * (u_chosen - u_rejected - dpop_lambda * torch.relu(-u_chosen)))


class DPOPModule(DPOModule):
    """DPOModule with the DPOP pair loss in place of the pair types of ``loss_type`` (an ``"sft"`` entry still adds
    RPO's term). The reference model, precomputed reference log-probs, counts and logged metrics are DPOModule's."""

    def __init__(self, model: Any = "tiny", *, dpop_lambda: float = 50.0, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)  # every __init__ argument is saved in self.hparams
        if dpop_lambda < 0:
            raise ValueError(f"`DPOPModule(dpop_lambda={dpop_lambda})` is invalid: use a penalty weight >= 0.")

    def pair_losses(self, scores: Scores, ref: Tensor, completion_mask: Tensor) -> Tensor:
        pairs, policy, hp = ref.numel() // 2, scores.seq, self.hparams  # rows 0..B-1: chosen, B..2B-1: rejected
        chosen, rejected, ref_chosen, ref_rejected = policy[:pairs], policy[pairs:], ref[:pairs], ref[pairs:]
        return dpop_loss(chosen, rejected, ref_chosen, ref_rejected, beta=hp.beta, dpop_lambda=hp.dpop_lambda)
