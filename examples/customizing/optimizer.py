"""Optimizer creation: a CausalLMModule subclass whose input embeddings learn at a lower rate."""

from __future__ import annotations

from typing import Any

import torch

from lit_trainer import CausalLMModule


class EmbeddingLRModule(CausalLMModule):
    """CausalLMModule whose input embeddings learn at ``embedding_lr_ratio`` times ``learning_rate``."""

    def __init__(self, model: Any = "tiny", *, embedding_lr_ratio: float = 0.1, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)  # every __init__ argument is saved in self.hparams

    def create_optimizer(self, named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        embedding = self.model.get_input_embeddings().weight
        lr = self.hparams.learning_rate
        groups = [
            {"params": [p for _, p in named if p is not embedding]},
            {"params": [p for _, p in named if p is embedding], "lr": lr * self.hparams.embedding_lr_ratio},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=self.hparams.weight_decay)
