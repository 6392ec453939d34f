"""RNG states as tensors and primitives (checkpoints load with ``weights_only=True``), for ``ExactResume``."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

RawRngState = tuple[Any, Any, torch.Tensor, "torch.Tensor | None"]


def capture_rng(device: torch.device | None = None) -> RawRngState:
    """The generator states as the libraries return them (cheap: called after every training batch).

    Args:
        device: the rank's device; its CUDA generator is included when it is a CUDA device.

    Returns:
        ``(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda state or None)``.
    """
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def restore_rng(raw: RawRngState, device: torch.device | None = None) -> None:
    """Set the generators to a state from :func:`capture_rng` (the CUDA one only on a CUDA ``device``)."""
    random.setstate(raw[0])
    np.random.set_state(raw[1])
    torch.set_rng_state(raw[2])
    if raw[3] is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(raw[3], device)


def rng_state_to_dict(raw: RawRngState) -> dict[str, Any]:
    """Tensors and primitives only (numpy's key vector as an int64 tensor), so ``weights_only=True`` loads it."""
    version, internal, gauss_next = raw[0]
    _, keys, pos, has_gauss, cached = raw[1]
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": raw[2],
    }
    if raw[3] is not None:
        state["cuda"] = raw[3]
    return state


def rng_state_from_dict(state: Mapping[str, Any]) -> RawRngState:
    """The inverse of :func:`rng_state_to_dict`."""
    py, npy = state["python"], state["numpy"]
    numpy_state = (
        "MT19937",
        npy["keys"].numpy().astype(np.uint32),
        npy["pos"],
        npy["has_gauss"],
        npy["cached_gaussian"],
    )
    return (
        (py["version"], tuple(py["state"].tolist()), py["gauss_next"]),
        numpy_state,
        state["torch"],
        state.get("cuda"),
    )


def collect_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's python, numpy, torch and (on a CUDA ``device``) CUDA generator states, as a plain dict."""
    return rng_state_to_dict(capture_rng(device))


def apply_rng_state(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Set the generators to a state made by :func:`collect_rng_state`."""
    restore_rng(rng_state_from_dict(state), device)
