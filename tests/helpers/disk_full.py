"""A disk that fills up partway through a write.

A full file system fails a write with ``OSError(ENOSPC)`` after it has taken the bytes that still fitted, so the
file being written is left truncated. The helpers below make the two writers of a run behave so: Lightning's
checkpoint writer (``TorchCheckpointIO``, through ``lightning.fabric.utilities.cloud_io._atomic_save``) and the
safetensors writer behind ``save_pretrained`` (the HF export). Each writes half of the real bytes under the name it
was given, then raises as the kernel would.
"""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.fabric.plugins.io.torch_io as torch_io
import pytest
import safetensors.torch
import torch
import transformers.modeling_utils


def _full(path: Any, data: bytes) -> OSError:
    Path(path).write_bytes(data[: len(data) // 2])
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def fill_disk_at_checkpoint(monkeypatch: pytest.MonkeyPatch, when: Callable[[dict, str], bool]) -> list[str]:
    """Checkpoint writes for which ``when(checkpoint, path)`` is true run out of space halfway; returns the paths
    they were writing to (the others are written normally)."""
    real, failed = torch_io._atomic_save, []

    def save(checkpoint: dict, path: Any) -> None:
        if not when(checkpoint, str(path)):
            real(checkpoint, path)
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        failed.append(str(path))
        raise _full(path, buffer.getvalue())

    monkeypatch.setattr(torch_io, "_atomic_save", save)
    return failed


def fill_disk_at_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``save_pretrained`` weights file runs out of space halfway."""

    def save_file(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        raise _full(filename, safetensors.torch.save(tensors, metadata=metadata))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
