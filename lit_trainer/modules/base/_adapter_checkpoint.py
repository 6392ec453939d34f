"""Adapter-only checkpoints: under peft a checkpoint holds what training changes, not the frozen base.

``drop_frozen`` removes every frozen parameter (the base model, a frozen ``"reference"`` adapter, an explicit frozen
reference model) from ``checkpoint["state_dict"]``; trainable parameters, buffers, optimizer, scheduler and callback
states stay. In its place the checkpoint records a fingerprint of the frozen weights (names, shapes, dtypes and a
float64 checksum), and ``check_frozen`` compares it on load: resuming onto a different base fails with an error instead
of silently training another model. The module loads non-strictly (Lightning's ``strict_loading = False``, the
documented way to load partial checkpoints); ``check_frozen`` makes sure every trainable parameter is in the file.

Under ``ModelParallelStrategy`` the checkpoint is a distributed one (a folder in which every rank writes its shards):
the module's ``state_dict`` then leaves the frozen parameters out (:func:`trainable_state`), so the strategy writes
and reads only the adapter shards (it asks the module for the keys to load), and ``meta.pt`` keeps the fingerprint.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from lit_trainer.core.sharding import full

FINGERPRINT_KEY = "lit_trainer_frozen_weights"


def frozen_names(module: torch.nn.Module) -> list[str]:
    """State-dict names of the frozen parameters of ``module`` (tied aliases included)."""
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


#: what bitsandbytes writes beside a quantized weight ``<module>.weight``: 4-bit constants under ``<module>.weight.``
#: (absmax, quant_map, nested_*, quant_state.*) and the 8-bit scales under ``<module>.`` (SCB, weight_format)
_INT8_EXTRAS = ("SCB", "weight_format")


def frozen_entries(module: torch.nn.Module, state: dict[str, Any]) -> list[str]:
    """Keys of ``state`` that belong to frozen parameters: the parameters themselves and, for a bitsandbytes-quantized
    base, the quantization constants saved beside them (frozen as well: they only decode the frozen weights)."""
    frozen = set(frozen_names(module))
    prefixes = tuple(f"{name}." for name in frozen)
    owners = {name.rpartition(".")[0] for name in frozen}
    return [
        key
        for key in state
        if key in frozen
        or key.startswith(prefixes)
        or (key.rpartition(".")[2] in _INT8_EXTRAS and key.rpartition(".")[0] in owners)
    ]


def trainable_names(module: torch.nn.Module) -> list[str]:
    """State-dict names of the trainable parameters of ``module`` (tied aliases included)."""
    return [n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]


@torch.no_grad()
def fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """``{"layout": sha256 of names/shapes/dtypes, "checksum": float64 sum of |w|}`` over the frozen parameters."""
    named = dict((n, p) for n, p in module.named_parameters() if not p.requires_grad)
    layout = hashlib.sha256("|".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named.items()).encode())
    # a sharded (DTensor) parameter's sum is a partial value: full() adds the ranks' parts (a collective that every
    # rank runs, in the same order: the save and load hooks run on all ranks)
    checksum = sum(float(full(p.detach().abs().sum(dtype=torch.float64))) for p in named.values())
    return {"layout": layout.hexdigest(), "checksum": checksum, "count": len(named)}


def drop_frozen(module: torch.nn.Module, checkpoint: dict[str, Any], cached: dict[str, Any] | None) -> dict[str, Any]:
    """Remove the frozen parameters from ``checkpoint["state_dict"]`` and record their fingerprint.

    Args:
        module: the LightningModule.
        checkpoint: the checkpoint being written.
        cached: the fingerprint computed at an earlier save (frozen weights do not change), or None.

    Returns:
        The fingerprint (for the caller to cache).
    """
    print_ = fingerprint(module) if cached is None else cached
    state = checkpoint.get("state_dict")
    if state is not None:
        for name in frozen_entries(module, state):
            state.pop(name, None)
    checkpoint[FINGERPRINT_KEY] = dict(print_)
    return print_


def check_frozen(module: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """Check an adapter-only checkpoint against the live module before Lightning loads it.

    Raises:
        ValueError: the checkpoint lacks trainable parameters of the module, or was made on other frozen weights.
    """
    saved = checkpoint.get(FINGERPRINT_KEY)
    # a distributed checkpoint (ModelParallelStrategy) has no "state_dict" here: the strategy has already loaded the
    # weights, and torch.distributed.checkpoint fails on a requested key the folder lacks, so nothing can be missing
    state = checkpoint.get("state_dict")
    missing = [] if state is None else [n for n in trainable_names(module) if n not in state]
    if missing:
        raise ValueError(
            f"The checkpoint has no values for trainable parameters {missing[:3]} (of {len(missing)}): "
            "it was written by a module with other adapters. Resume with the same peft_config / "
            "adapter_path as the run that wrote it."
        )
    if saved is None:
        return  # a full checkpoint: every weight is in the file
    live = fingerprint(module)
    same = saved["layout"] == live["layout"] and math.isclose(saved["checksum"], live["checksum"], rel_tol=1e-6)
    if not same:
        raise ValueError(
            "The checkpoint holds only the trainable (adapter) weights, and the frozen base weights of "
            "this module differ from those it was trained on (layout or checksum of the "
            f"{live['count']} frozen tensors, saved {saved['count']}). Build the module on the same base "
            "model as the run that wrote the checkpoint."
        )


def trainable_state(module: torch.nn.Module, state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``state`` (a ``module.state_dict(prefix=prefix)``) without the frozen parameters: trainable parameters and
    buffers stay."""
    for name in frozen_names(module):
        state.pop(prefix + name, None)
    return state
