"""BEMA's Hugging Face export: the module's ``.model`` saved with the BEMA weights in place of the trained ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from lit_trainer.callbacks.bema._shards import gather
from lit_trainer.callbacks.hf_export import export_hf, saved_tokenizer
from lit_trainer.core.sharding import full_state_dict, is_sharded


def export_bema_weights(
    trainer: Any, pl_module: Any, target: Path, bema: list[Tensor], params: list[Tensor], alias: dict[str, int]
) -> None:
    """``save_pretrained`` ``pl_module.model`` (and its tokenizer or processor) into ``target`` with the BEMA weights.

    Every rank calls it (sharded: the full weights are collectives); rank 0 writes, under a partial name renamed
    into place (:func:`~lit_trainer.callbacks.hf_export.export_hf`), then all ranks meet at a barrier.

    Args:
        bema, params: the BEMA buffers (local shards when sharded) and the parameters they average.
        alias: every ``pl_module.state_dict()`` key of a tracked parameter (tied aliases too) -> its index in
            ``bema``; the model's other weights (frozen ones) are saved as they are.
    """
    model = pl_module.model
    sharded = is_sharded(model)
    state = full_state_dict(model) if sharded else None  # sharded: collectives every rank joins
    full = gather(bema, params)
    if trainer.is_global_zero:
        weights = state if sharded else model.state_dict()  # tied keys share a tensor
        for key in weights:
            if "model." + key in alias:
                weights[key] = full[alias["model." + key]]
        export_hf(model, saved_tokenizer(trainer, pl_module), target, state_dict=weights)
    trainer.strategy.barrier("bema_export")
