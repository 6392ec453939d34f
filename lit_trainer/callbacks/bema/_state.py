"""BEMA's checkpoint state: its layout, where it is in a checkpoint, and turning it back into buffers.

The state (``checkpoint["callbacks"][bema.state_key]``) holds plain types and full tensors only, so it loads with
``weights_only=True``: ``{"format": 1, "initialized": True, "step", "num_updates", "hparams", "theta0", "ema",
"bema"}`` with each buffer a ``{parameter name: tensor}``; before training starts it is
``{"format": 1, "initialized": False}``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lit_trainer.callbacks.bema._shards import gather, local_shard_like
from lit_trainer.checkpoint_load import load_checkpoint

FORMAT = 1
BUFFERS = ("theta0", "ema", "bema")  # the buffer entries of the state, in this order


def empty_state() -> dict[str, Any]:
    """The state of a BEMA that has no weights yet."""
    return {"format": FORMAT, "initialized": False}


def pack_state(
    names: list[str],
    params: list[Tensor],
    buffers: tuple[list[Tensor], list[Tensor], list[Tensor]],
    step: int,
    num_updates: int,
    hparams: dict[str, float],
) -> dict[str, Any]:
    """The checkpoint state of the ``(theta0, ema, bema)`` buffers of ``params`` (full tensors: a collective when
    sharded, so every rank calls it; rank 0's state is the one saved)."""
    return {
        "format": FORMAT,
        "initialized": True,
        "step": step,
        "num_updates": num_updates,
        "hparams": hparams,
        **{key: dict(zip(names, gather(b, params))) for key, b in zip(BUFFERS, buffers)},
    }


def check_format(state: dict[str, Any]) -> None:
    """``ValueError`` unless ``state`` has the layout this version writes."""
    if state.get("format") != FORMAT:
        raise ValueError(f"BEMA checkpoint state has format {state.get('format')!r}, expected {FORMAT}.")


def unpack_buffers(
    state: dict[str, Any], names: list[str], params: list[Tensor], device_of: Callable[[Tensor], torch.device]
) -> tuple[list[Tensor], ...]:
    """The ``(theta0, ema, bema)`` buffers of an initialized ``state`` for ``params`` (this rank's shards when
    sharded, each on ``device_of(param)`` in the parameter's dtype).

    Raises:
        ValueError: the state's parameter names or shapes are not the module's.
    """
    saved = list(state["bema"])
    if sorted(saved) != sorted(names):
        missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        raise ValueError(
            f"The BEMA checkpoint state does not match the module's trainable parameters "
            f"(missing from the checkpoint: {missing[:5]}, unknown: {extra[:5]}). Resume with the "
            "same trainable parameters, or drop the BEMA entry of `checkpoint['callbacks']`."
        )
    for name, p in zip(names, params):
        if state["bema"][name].shape != p.shape:
            raise ValueError(
                f"BEMA checkpoint shape {tuple(state['bema'][name].shape)} for {name!r} does not "
                f"match the parameter's {tuple(p.shape)}."
            )
    return tuple(
        [local_shard_like(state[key][n], p).to(device_of(p), p.dtype, copy=True) for n, p in zip(names, params)]
        for key in BUFFERS
    )


def bema_state_keys(callback_states: dict[str, Any], qualname: str = "BEMA") -> list[str]:
    """The keys of ``checkpoint["callbacks"]`` that hold a BEMA state: ``"BEMA{settings}"``, or ``"BEMA"`` (the
    class-name key of checkpoints written before the settings were part of the key)."""
    return [k for k in callback_states if isinstance(k, str) and (k == qualname or k.startswith(qualname + "{"))]


def bema_state_from_checkpoint(path: str | os.PathLike, state_key: str | None, qualname: str) -> dict[str, Any]:
    """The (initialized) BEMA state ``state_key`` (or the only one) of a ``.ckpt`` file or distributed checkpoint
    folder (whose callback states are in its ``meta.pt``), loaded safely (:func:`lit_trainer.checkpoint_load.
    load_checkpoint`); ``ValueError`` else."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    file = Path(path) / _METADATA_FILENAME if Path(path).is_dir() else path  # a distributed checkpoint folder
    states = load_checkpoint(file).get("callbacks", {})
    keys = [state_key] if state_key is not None else bema_state_keys(states, qualname)
    if len(keys) != 1 or keys[0] not in states:
        raise ValueError(
            f"The checkpoint {str(path)!r} holds {len(keys)} BEMA states ({keys}): pass "
            "`state_key=` (the callback's `state_key`) to choose one."
        )
    state = states[keys[0]]
    if not state.get("initialized"):
        raise ValueError(f"The checkpoint {str(path)!r} holds no BEMA weights (saved before training started).")
    return state
