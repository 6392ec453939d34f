"""lit_trainer: Hugging Face Trainer / TRL recipes as PyTorch Lightning parts.

The modules load on first use (``from lit_trainer import CausalLMModule`` works as usual), so ``import lit_trainer``
alone imports neither torch nor Lightning: the ``lit-trainer`` command answers ``--help`` at once and can set OpenMP
defaults before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "CPOModule",
    "CausalLMModule",
    "DPOModule",
    "DistillationModule",
    "GRPOModule",
    "KTOModule",
    "ORPOModule",
    "RLOOModule",
    "RewardModule",
]

if TYPE_CHECKING:
    from lit_trainer.modules import (
        CausalLMModule,
        CPOModule,
        DistillationModule,
        DPOModule,
        GRPOModule,
        KTOModule,
        ORPOModule,
        RewardModule,
        RLOOModule,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("lit_trainer.modules"), name)
    raise AttributeError(f"module 'lit_trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
