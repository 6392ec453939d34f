"""HFExport: write the trained model (and tokenizer) in Hugging Face format at the end of fit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_trainer._atomic import atomic_directory


def export_hf(model: Any, tokenizer: Any, target: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """``save_pretrained`` the model (safetensors) and tokenizer into ``target`` atomically.

    Everything is written into a temporary sibling directory that replaces ``target`` only once complete
    (:func:`~lit_trainer._atomic.atomic_directory`), so a crash never leaves a directory that looks like a
    finished export.

    Args:
        model: a transformers model.
        tokenizer: its tokenizer, or None.
        target: the export directory.
        state_dict: weights to save instead of the model's current ones (e.g. a best or averaged copy).

    Raises:
        TypeError: when ``model`` has no ``save_pretrained``.
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"Cannot export {type(model).__name__} in HF format: it has no `save_pretrained`.")
    with atomic_directory(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
    return Path(target)


class HFExport(Callback):
    """Export ``pl_module.model`` (and ``pl_module.tokenizer``) with ``save_pretrained`` when fit ends.

    Works on any LightningModule that exposes an HF model as ``.model``; the result loads with
    ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``. Written by global rank 0 only.

    Args:
        dirpath: export directory; default ``<trainer.log_dir>/hf_model`` (or ``<default_root_dir>/hf_model``).

    Example::

        trainer = Trainer(callbacks=[HFExport()])
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.last_export: str | None = None

    def resolve_dir(self, trainer: pl.Trainer) -> Path:
        """Where the export goes for this trainer."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "hf_model"

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = self.resolve_dir(trainer)
        model = getattr(pl_module, "model", None)
        if model is None or not hasattr(model, "save_pretrained"):
            raise TypeError(f"HFExport needs `{type(pl_module).__name__}.model` to be a transformers model with "
                            "`save_pretrained`; remove the callback for other modules.")
        if trainer.is_global_zero:
            export_hf(model, getattr(pl_module, "tokenizer", None), target)
            rank_zero_info(f"[lit_trainer] exported the model in HF format to {target}")
        self.last_export = str(target)
        trainer.strategy.barrier("hf_export")
