"""Refuse padding-free packing on a model or attention implementation that would let packed rows see each other.

transformers keeps packed rows apart only when the model builds its mask with ``masking_utils`` (it detects the
``position_ids`` restarting at 0 when no attention mask is given) or passes them to a varlen flash kernel. A model
that ignores ``position_ids`` (state-space models, custom code) or an attention function that ignores the mask
(a registered kernel that only applies ``is_causal``) would silently train on cross-row attention. Rather than a
list of names that goes stale, :func:`check_packing_support` runs a tiny probe through the model itself.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_trainer.data.packing import unpack_rows


def _logits(model: torch.nn.Module, ids: list[int], positions: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.tensor([positions], device=device),
        use_cache=False,
    )
    return out.logits[0].float()


def packing_leak(model: torch.nn.Module) -> float:
    """How much a packed row's logits move when the row packed before it changes, relative to the logit scale.

    Packs ``a + b`` and ``a' + b`` (``a`` and ``a'`` different random tokens of the same length) with
    ``position_ids`` restarting at ``b``, and also runs ``b`` alone; returns the largest difference of ``b``'s logits
    over these three runs divided by ``1 + max |logit|``. About 0 (float rounding) when rows are kept apart.
    """
    vocab = int(getattr(model.config, "vocab_size", 0) or model.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(0)
    a, a2, b = (torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (6, 6, 5))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = _logits(model, b, list(range(len(b))))
            after_a = _logits(model, a + b, list(range(len(a))) + list(range(len(b))))[len(a) :]
            after_a2 = _logits(model, a2 + b, list(range(len(a2))) + list(range(len(b))))[len(a2) :]
    finally:
        model.train(was_training)
    diff = max((after_a - alone).abs().max(), (after_a2 - alone).abs().max())
    return float(diff / (1.0 + alone.abs().max()))


def check_packing_support(model: torch.nn.Module, packing: str) -> None:
    """Raise when ``model`` cannot keep packed rows apart (see :func:`packing_leak`).

    Raises:
        ValueError: names the attention implementation, the measured leak and the fix.
    """
    leak = packing_leak(model)
    dtype = next(model.parameters()).dtype
    tolerance = 1e-4 if dtype == torch.float32 or dtype == torch.float64 else 2e-2
    if leak > tolerance:
        attn = getattr(model.config, "_attn_implementation", None)
        raise ValueError(
            f"`packing={packing!r}` needs a model that keeps packed rows apart, but {type(model).__name__} with "
            f"attn_implementation={attn!r} lets a packed row see the row before it (its logits move by {leak:.2g} of "
            "their scale when that row changes). Use packing='none', or a model whose attention builds its mask from "
            "`position_ids` (transformers models with attn_implementation 'sdpa', 'eager', 'flex_attention' or "
            "'flash_attention_2')."
        )


def datamodule_packing(trainer: Any) -> str:
    """The ``packing`` option of the trainer's lit_trainer data module (``"none"`` without one)."""
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    hparams = getattr(datamodule, "hparams", None)
    return str(hparams.get("packing", "none")) if hparams is not None else "none"


def check_trainer_packing(trainer: Any, *models: torch.nn.Module | None) -> None:
    """At ``fit`` setup: when the trainer's data module packs, check every distinct model given (None skipped)."""
    packing = datamodule_packing(trainer)
    if packing != "none":
        for model in {id(m): m for m in models if m is not None}.values():
            check_packing_support(model, packing)


def masking_kwargs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What keeps a batch's rows apart in the model call: ``attention_mask`` (padded) or ``position_ids`` (packed)."""
    if "seq_lengths" in batch:
        return {"position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"]}


def per_row(batch: dict[str, torch.Tensor], *shifted: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Shifted per-position values of a batch, per row: split back with ``seq_lengths`` when the batch is packed."""
    if "seq_lengths" not in batch:
        return shifted
    rows = batch["seq_lengths"]
    return tuple(None if x is None else unpack_rows(x, rows, shifted=True) for x in shifted)
