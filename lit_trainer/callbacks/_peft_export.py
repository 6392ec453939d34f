"""Export of a peft (adapter) model: the adapter alone, or the base with the adapter merged in.

Duck-typed (callbacks do not import the modules): a peft model is anything with ``peft_config`` and
``merge_and_unload``. The adapter export is ``PeftModel.save_pretrained`` of the trained adapter only (a frozen
reference adapter is left out); it loads with ``PeftModel.from_pretrained(base, path)`` on the same base model. The
merged export is a standalone transformers model (``AutoModelForCausalLM.from_pretrained(path)``); it merges a copy,
so it needs memory for a second copy of the model while it is written, and training continues on the unmerged weights.
"""

from __future__ import annotations

import copy
import os
from typing import Any


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
    merged = copy.deepcopy(model)
    if state_dict is not None:
        merged.load_state_dict(state_dict, strict=False)
    merged = merged.merge_and_unload()
    merged.save_pretrained(directory, safe_serialization=True)
