"""Small in-memory datasets for the tests."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def regression_data(seed: int, n: int = 32) -> TensorDataset:
    """``n`` rows of ``x ~ N(0, 1)^4`` with target ``y = sum(x)`` (shape ``(n, 1)``), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))
