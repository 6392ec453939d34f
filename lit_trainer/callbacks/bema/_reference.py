"""BEMA's reference-model refresh: which ``pl_module.ref_model`` parameter receives each BEMA weight."""

from __future__ import annotations

import torch

from lit_trainer.callbacks.bema._shards import same_layout
from lit_trainer.core.sharding import local


def ref_model_name(name: str, ref_names: set[str]) -> str | None:
    """Name in ``pl_module.ref_model`` of the tracked parameter ``name`` (relative to the LightningModule).

    ``model.<rest>`` maps to ``<rest>`` when the reference model has it (``ref_model`` mirrors ``pl_module.model``,
    the DPO layout); otherwise a name maps to itself (``ref_model`` mirrors the LightningModule).

    Args:
        name: e.g. ``"model.model.layers.0.mlp.up_proj.weight"``.
        ref_names: every parameter name of the reference model (aliases of tied weights included).

    Returns:
        The reference model's name (``"model.layers.0.mlp.up_proj.weight"``), or ``None`` when nothing matches.
    """
    if name.startswith("model.") and name[len("model.") :] in ref_names:
        return name[len("model.") :]
    return name if name in ref_names else None


def resolve_ref_params(pl_module: torch.nn.Module, tracked: dict[str, torch.nn.Parameter]) -> list[torch.Tensor]:
    """``pl_module.ref_model``'s counterparts of the tracked parameters, checked (exists, frozen, names, shapes).

    Raises:
        ValueError: naming what is wrong and the fix.
    """
    ref = getattr(pl_module, "ref_model", None)
    if not isinstance(ref, torch.nn.Module):
        raise ValueError(
            f"`BEMA(update_ref_model=True)` needs `pl_module.ref_model` (a torch.nn.Module), but "
            f"{type(pl_module).__name__}.ref_model is {type(ref).__name__}{getattr(ref, 'why', '')}. "
            "Give the module a frozen reference model, or set update_ref_model=False."
        )
    ref_named = dict(ref.named_parameters(remove_duplicate=False))
    live_ptrs = {local(p).data_ptr() for p in tracked.values()}
    shared = [n for n, p in ref_named.items() if local(p).data_ptr() in live_ptrs]
    if shared:
        raise ValueError(
            f"`pl_module.ref_model` has parameters that are being trained ({shared[:3]}): it is "
            "the policy itself or not frozen, and BEMA would overwrite the policy. Give it its own "
            "frozen copy, e.g. `copy.deepcopy(model).requires_grad_(False)`."
        )
    ref_names = set(ref_named)
    mapped = {n: ref_model_name(n, ref_names) for n in tracked}
    missing = [n for n, r in mapped.items() if r is None or ref_named[r].shape != tracked[n].shape]
    if missing:
        raise ValueError(
            f"`pl_module.ref_model` has no parameter matching {missing[:5]} (name and shape). "
            "Tracked names map `model.<rest>` -> `<rest>`, other names to themselves."
        )
    unlike = [n for n in tracked if not same_layout(ref_named[mapped[n]], tracked[n])]
    if unlike:
        raise ValueError(
            f"`pl_module.ref_model` is not sharded like the policy ({unlike[:3]}): BEMA copies its "
            "weights shard by shard, so under ModelParallelStrategy shard the reference model the same "
            "way in `configure_model` (as DPOModule does), or set update_ref_model=False."
        )
    return [ref_named[mapped[n]] for n in tracked]
