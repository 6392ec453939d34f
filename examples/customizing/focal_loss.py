"""Focal loss: a CausalLMModule subclass that changes what is computed per token, still token-exact."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_trainer import CausalLMModule
from lit_trainer.losses.logprobs import IGNORE_INDEX


def focal_causal_lm_loss(logits: Tensor, labels: Tensor, num_items_in_batch: Tensor | None, gamma: float) -> Tensor:
    """``Σ_t (1 − p_t)^γ · CE_t / num_items_in_batch`` over the shifted target tokens (``γ = 0``: cross entropy)."""
    logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    labels = labels[..., 1:].reshape(-1)
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")  # 0 where ignored
    per_token = (1.0 - torch.exp(-ce)) ** gamma * ce
    count = (labels != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    return per_token.sum() / count.clamp(min=1)  # a SUM over tokens / the step's count: token-exact


class FocalLossLM(CausalLMModule):
    """CausalLMModule trained with the focal loss; every other option is CausalLMModule's."""

    def __init__(self, model: Any = "tiny", *, gamma: float = 2.0, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)  # every __init__ argument is saved in self.hparams
        if gamma < 0:
            raise ValueError(f"`FocalLossLM(gamma={gamma})` is invalid: use gamma >= 0 (0 is the plain loss).")

    def compute_loss(self, batch: dict[str, Any], num_items_in_batch: Tensor | None) -> tuple[Tensor, dict]:
        outputs = self(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
        return focal_causal_lm_loss(outputs.logits, batch["labels"], num_items_in_batch, self.hparams.gamma), {}
