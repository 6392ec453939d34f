"""HFExport: write the trained model (and tokenizer, or a vision-language model's processor) in Hugging Face format at
the end of fit.

:func:`export_hf` is the one writer (``BestCheckpoint``'s ``best/`` and BEMA's export use it too). A peft (adapter)
model is exported as the adapter alone, or as the base with the adapter merged in. Duck-typed (callbacks do not import
the modules): a peft model is anything with ``peft_config`` and ``merge_and_unload``. The adapter export is
``PeftModel.save_pretrained`` of the trained adapter only (a frozen reference adapter is left out); it loads with
``PeftModel.from_pretrained(base, path)`` on the same base model. The merged export is a standalone transformers model
(``AutoModelForCausalLM.from_pretrained(path)``); it merges a copy, so it needs memory for a second copy of the model
while it is written, and training continues on the unmerged weights. On a quantized base (QLoRA) the copy is
dequantized and cast back to the base's original dtype before the merge, so the merged export needs no bitsandbytes
(:func:`lit_trainer.quantization.merged_full_precision`).

A vision-language model (``tiny-vl``, a saved image-text-to-text model) is exported with its processor instead of the
bare tokenizer (:func:`saved_tokenizer`): the image processor's settings, the tokenizer and the chat template, so
``AutoProcessor.from_pretrained(path)`` and ``AutoModelForImageTextToText.from_pretrained(path)`` reload the run.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_trainer.checkpoint_io import checkpoint_bytes
from lit_trainer.core.atomic import atomic_directory, is_out_of_space, no_space_error
from lit_trainer.core.lightning_namespace import PackageBound
from lit_trainer.core.sharding import full_state_dict, is_sharded
from lit_trainer.quantization import is_quantized, merged_full_precision


def is_adapter_model(model: Any) -> bool:
    """Whether ``model`` is a peft model (duck-typed)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "merge_and_unload", None))


def save_adapter_model(model: Any, directory: str | os.PathLike, state_dict: dict | None, merge: bool) -> None:
    """Write ``model``'s active adapter (or, with ``merge``, the merged model) into ``directory``.

    Args:
        model: a ``peft.PeftModel``.
        directory: an existing, empty directory.
        state_dict: weights to export instead of the live ones (keys as ``model.state_dict()``; adapter keys suffice).
        merge: write the merged full model instead of the adapter.
    """
    if not merge:
        model.save_pretrained(
            directory, safe_serialization=True, state_dict=state_dict, selected_adapters=[model.active_adapter]
        )
        return
    if is_quantized(model):  # QLoRA: dequantize, cast back to the base's dtype, merge (a plain transformers model)
        merged_full_precision(model, state_dict).save_pretrained(directory, safe_serialization=True)
        return
    merged = copy.deepcopy(model)
    if state_dict is not None:
        merged.load_state_dict(state_dict, strict=False)
    merged = merged.merge_and_unload()
    merged.save_pretrained(directory, safe_serialization=True)


def saved_tokenizer(trainer: Any, pl_module: Any) -> Any:
    """What an export saves next to the model: the processor of a vision-language run, else the module's tokenizer.

    The processor is the data module's (``BaseDataModule.processor``, set for ``tiny-vl`` or a saved vision-language
    model), else the module's own ``processor`` attribute if it has one; None when there is neither a processor nor a
    tokenizer. A processor's ``save_pretrained`` writes its tokenizer and chat template too.
    """
    for owner in (getattr(trainer, "datamodule", None), pl_module):
        processor = getattr(owner, "processor", None)
        if processor is not None and callable(getattr(processor, "save_pretrained", None)):
            return processor
    return getattr(pl_module, "tokenizer", None)


def export_hf(
    model: Any, tokenizer: Any, target: str | os.PathLike, state_dict: dict | None = None, merge_adapters: bool = False
) -> Path:
    """``save_pretrained`` the model (safetensors) and tokenizer into ``target`` atomically.

    Everything is written into a temporary sibling directory that replaces ``target`` only once complete
    (:func:`~lit_trainer.core.atomic.atomic_directory`), so a crash never leaves a directory that looks like a
    finished export; a write that fails (a full disk) removes the temporary directory and leaves ``target`` as it was.

    Args:
        model: a transformers model.
        tokenizer: its tokenizer or processor (anything with ``save_pretrained``), or None.
        target: the export directory.
        state_dict: weights to save instead of the model's current ones (e.g. a best or averaged copy).
        merge_adapters: for a peft model, write the base with the adapter merged in (a standalone transformers
            model) instead of the adapter alone (see the module docstring).

    Raises:
        TypeError: when ``model`` has no ``save_pretrained``.
        NoSpaceError: when the disk is full (or over quota): one line naming the folder, about how many bytes the
            weights need (not known for an adapter alone) and the space free.
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"Cannot export {type(model).__name__} in HF format: it has no `save_pretrained`.")
    try:
        with atomic_directory(target) as tmp:
            if is_adapter_model(model):
                save_adapter_model(model, tmp, state_dict, merge_adapters)
            else:
                model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(tmp)
    except OSError as error:
        if not is_out_of_space(error):
            raise
        weights = state_dict if state_dict is not None else model.state_dict()
        needed = None if is_adapter_model(model) and not merge_adapters else checkpoint_bytes(weights)
        raise no_space_error(error, "the HF export", Path(target), needed) from error
    return Path(target)


class _HFExport(PackageBound):
    """Export ``pl_module.model`` (and ``pl_module.tokenizer``) with ``save_pretrained`` when fit ends.

    Works on any LightningModule that exposes an HF model as ``.model``; the result loads with
    ``AutoModelForCausalLM.from_pretrained`` (a ``RewardModule``'s with ``AutoModelForSequenceClassification``) /
    ``AutoTokenizer.from_pretrained``. A vision-language run saves the data module's processor instead of the tokenizer
    (:func:`saved_tokenizer`), and reloads with ``AutoModelForImageTextToText`` / ``AutoProcessor``. Written by global
    rank 0 only.
    A module without such a ``.model`` is refused in ``on_fit_start``, before the first training step. Under
    ``ModelParallelStrategy`` (FSDP2) the full weights are gathered to rank 0's CPU first (every rank takes part).
    For a peft (LoRA) model it writes the adapter, which loads with ``peft.PeftModel.from_pretrained(base, dirpath)``
    on the same base model, or with ``merge_adapters=True`` the merged model; the tokenizer goes with both. A sharded
    peft model gathers only its trainable adapter to rank 0; ``merge_adapters=True`` is refused there.

    Args:
        dirpath: export directory; default ``<trainer.log_dir>/hf_model`` (or ``<default_root_dir>/hf_model``).
        merge_adapters: peft models only: export the base with the adapter merged in instead of the adapter.

    Example::

        trainer = Trainer(callbacks=[HFExport()])
    """

    def __init__(self, dirpath: str | None = None, merge_adapters: bool = False) -> None:
        self.dirpath = dirpath
        self.merge_adapters = merge_adapters
        self.last_export: str | None = None

    def resolve_dir(self, trainer: pl.Trainer) -> Path:
        """Where the export goes for this trainer."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "hf_model"

    @staticmethod
    def check_module(pl_module: pl.LightningModule) -> None:
        """Refuse a module whose ``.model`` cannot be saved with ``save_pretrained`` (called before training).

        Raises:
            TypeError: naming what is missing and the fix.
        """
        name = type(pl_module).__name__
        model = getattr(pl_module, "model", None)
        if callable(getattr(model, "save_pretrained", None)):
            return
        found = f"{name} has no `.model`" if model is None else f"`{name}.model` is a {type(model).__name__}"
        raise TypeError(
            f"HFExport needs `{name}.model` to be a transformers model with `save_pretrained`, but "
            f"{found}. Expose the model as `self.model` (e.g. an `AutoModelForCausalLM`), or remove "
            "HFExport for other modules."
        )

    def check_merge(self, pl_module: pl.LightningModule) -> None:
        """Refuse ``merge_adapters=True`` for a sharded peft model (called before training): merging needs the whole
        base on one rank.

        Raises:
            ValueError: naming the fix (merge the exported adapter offline).
        """
        model = pl_module.model
        if self.merge_adapters and is_adapter_model(model) and is_sharded(model):
            raise ValueError(
                "HFExport(merge_adapters=True) is not supported for a sharded (ModelParallelStrategy) peft model: "
                "merging needs the whole base model on one rank. Export the adapter (merge_adapters=False) and "
                "merge it offline: `peft.PeftModel.from_pretrained(base, dirpath).merge_and_unload()`."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_module(pl_module)  # after configure_model (a lazily built .model exists), before any step
        self.check_merge(pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = self.resolve_dir(trainer)
        model = pl_module.model
        # sharded (FSDP2): the full weights, gathered on rank 0 (a collective every rank joins); of a peft model
        # only the trainable adapter is gathered (the export holds nothing else)
        state = full_state_dict(model, trainable_only=is_adapter_model(model)) if is_sharded(model) else None
        if trainer.is_global_zero:
            export_hf(
                model,
                saved_tokenizer(trainer, pl_module),
                target,
                state_dict=state,
                merge_adapters=self.merge_adapters,
            )
            self._ns.rank_zero_info(f"[lit_trainer] exported the model in HF format to {target}")
        self.last_export = str(target)
        trainer.strategy.barrier("hf_export")


class HFExport(_HFExport, Callback):
    __doc__ = _HFExport.__doc__
