"""Plain LightningModules (not from lit_trainer), the kind a user writes, for the callback tests.

``TinyLM`` (embedding -> dropout -> linear next-token model), ``TinyHF`` (a tiny transformers Llama as ``.model``),
``Regressor`` (an MLP on ``(x, y)`` batches) and ``DropoutRegressor`` (an MLP with dropout) are built on
``lightning.pytorch``; :func:`on_pytorch_lightning` rebuilds any of them on ``pytorch_lightning``. Each public class is
``class X(_X, LightningModule)`` with the implementation in ``_X``, so the rebuilt class shares it."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import tiny_llama

Optimizer = Literal["sgd", "adam", "adamw"]
_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def batch_ids(batch: Any) -> torch.Tensor:
    """The token ids of a batch: a tensor, the first item of a ``(ids, ...)`` tuple, or ``input_ids``/``ids``."""
    if isinstance(batch, dict):
        return batch["input_ids"] if "input_ids" in batch else batch["ids"]
    return batch[0] if isinstance(batch, (list, tuple)) else batch


class _LMSteps:
    """Steps shared by the LM modules: next-token loss (``_loss``, per module), ``val_loss``, the optimizer.

    With ``record_noise`` each step appends to ``seen[stage]`` the largest difference between the input embedding's
    output and a plain lookup of its weights: the noise a NEFTune hook added (one extra embedding call per step).
    """

    def _lm_setup(self, lr: float, optimizer: Optimizer, record_noise: bool) -> None:
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(_OPTIMIZERS)}")
        self.lr, self.optimizer_name, self.record_noise = lr, optimizer, record_noise
        self.seen: dict[str, list[float]] = {"train": [], "val": [], "predict": []}

    def _record(self, stage: str, ids: torch.Tensor) -> None:
        if self.record_noise:
            embedding = self.get_input_embeddings()
            self.seen[stage].append((embedding(ids) - F.embedding(ids, embedding.weight)).abs().max().item())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch_ids(batch)
        self._record("train", ids)
        return self._loss(ids)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids = batch_ids(batch)
        self._record("val", ids)
        self.log("val_loss", self._loss(ids), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch_ids(batch)
        self._record("predict", ids)
        return self(ids)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _OPTIMIZERS[self.optimizer_name](self.parameters(), lr=self.lr)


class _TinyLM(_LMSteps):
    def __init__(
        self,
        vocab: int = 16,
        dim: int = 8,
        dropout: float = 0.0,
        lr: float = 0.05,
        optimizer: Optimizer = "adam",
        record_noise: bool = False,
    ) -> None:
        super().__init__()
        self.embed, self.drop, self.head = nn.Embedding(vocab, dim), nn.Dropout(dropout), nn.Linear(dim, vocab)
        self._lm_setup(lr, optimizer, record_noise)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.drop(self.embed(input_ids)))

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self(ids)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class TinyLM(_TinyLM, L.LightningModule):
    """Embedding -> dropout -> linear next-token model; batches are ids, ``(ids, ...)`` or ``{"input_ids"|"ids"}``."""


class _TinyHF(_LMSteps):
    def __init__(self, lr: float = 0.5, optimizer: Optimizer = "sgd", record_noise: bool = False, **llama: Any) -> None:
        super().__init__()
        self.model = tiny_llama(**llama)
        self._lm_setup(lr, optimizer, record_noise)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


class TinyHF(_TinyHF, L.LightningModule):
    """A user's module around a transformers model (``.model``, from :func:`helpers.models.tiny_llama` with
    ``**llama``), trained on its own next-token loss."""


class _Regressor:
    def __init__(self, hidden: int | None = 8, lr: float = 0.05, seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1)) if hidden else nn.Linear(4, 1)
        self.lr = lr

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Regressor(_Regressor, L.LightningModule):
    """A regression MLP 4 -> ``hidden`` -> 1 (``hidden=None``: one linear layer) on ``(x, y)`` batches, SGD."""


class _DropoutRegressor:
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.5)


class DropoutRegressor(_DropoutRegressor, L.LightningModule):
    """A regression MLP 4 -> 16 -> 1 with dropout (so resuming must restore the RNG) on ``(x, y)`` batches with 1-D
    targets, SGD with momentum; the same weights each time (seed 0); logs ``val_loss`` when validated."""


def on_pytorch_lightning(cls: type) -> type:
    """``cls`` (one of this module's ``class X(_X, lightning.pytorch.LightningModule)``) rebuilt on
    ``pytorch_lightning.LightningModule``, with the same implementation."""
    import pytorch_lightning

    body, base = cls.__bases__
    if base is not L.LightningModule:
        raise TypeError(f"{cls.__name__} is not built as `class X(_X, lightning.pytorch.LightningModule)`")
    return type(
        cls.__name__,
        (body, pytorch_lightning.LightningModule),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
    )
