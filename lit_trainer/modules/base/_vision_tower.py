"""The vision tower and projector of a vision-language model under training (``train_vision_tower``).

A vision-language model (``lit_trainer.models.is_vision_model``) is a vision tower (an image encoder: LLaVA's CLIP
``model.vision_tower``), a projector that maps the tower's features into the language model's embedding space
(LLaVA's ``model.multi_modal_projector``) and the language model. They are found by their attribute names
(:data:`TOWER_NAMES`, :data:`PROJECTOR_NAMES`; the shallowest module of such a name).

* ``train_vision_tower=False`` (the default): the tower's parameters are frozen, in full fine-tuning and under peft.
  With a ``peft_config`` its modules are excluded from the adapters (peft's ``exclude_modules``), so ``target_modules:
  all-linear`` puts LoRA on the language model only.
* The projector is trained: fully in full fine-tuning, and under peft by default too, as a full trainable copy
  (peft's ``modules_to_save``) rather than through adapters. It is small (a 2-layer MLP: well under 1% of a
  LLaVA-7B) and it is the one part that learns how image features enter the language model, which LLaVA trains
  fully in every stage. A ``peft_config`` that sets ``modules_to_save`` itself (``[]`` included) decides alone: then
  ``target_modules`` decides whether the projector gets adapters.
* ``train_vision_tower=True``: nothing is frozen in full fine-tuning; under peft the tower gets adapters where
  ``target_modules`` matches its layers (e.g. ``all-linear``, or ``q_proj``/``v_proj``, names CLIP shares with
  Llama); a config whose adapters miss the tower entirely is refused. To train the whole tower under peft, name it in
  ``modules_to_save``.

A micro-batch without images (rows without images only) does not run the tower and projector: their trainable
parameters would have no gradient on that rank, and DDP (whose all-reduce waits for every trainable parameter) hangs,
as does FSDP2 (whose reduce-scatter covers the gradients that exist, so the ranks would send different sizes).
:func:`image_free_term` runs them on a blank image and returns zero times the result: added to the loss it changes
neither the loss nor any gradient (exact zeros), and every rank holds the same gradients.

Under FSDP2 (``ModelParallelStrategy``) the tower is sharded with the root group, not block by block
(:func:`tower_block_classes` are left out of the default ``shard_blocks``, though LLaVA's ``_no_split_modules`` names
the CLIP layers): its weights are sharded at rest (1/W per rank) and all-gathered once per forward with the
embeddings and the head, on every rank, images or not. Sharded block by block, a rank whose micro-batch has no image
would skip the tower's all-gathers while the others wait in them. A tower is small beside its language model
(CLIP-L's 0.3 B parameters beside a 7 B LLaVA), so gathering it whole costs little memory.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lit_trainer.models import is_vision_model

#: attribute names of vision towers (LLaVA, Gemma 3, PaliGemma: ``vision_tower``; Qwen2-VL: ``visual``; Idefics3,
#: SmolVLM, Mllama: ``vision_model``)
TOWER_NAMES = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder")
#: attribute names of projectors (LLaVA, Gemma 3, Mllama: ``multi_modal_projector``; Idefics3: ``connector``; Qwen2-VL:
#: ``merger``, inside its tower)
PROJECTOR_NAMES = ("multi_modal_projector", "mm_projector", "connector", "merger")


def _shallowest(model: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    found = [n for n, _ in model.named_modules() if n and n.rpartition(".")[2] in names]
    return min(found, key=lambda n: n.count("."), default=None)


def tower_name(model: torch.nn.Module) -> str | None:
    """The module name of ``model``'s vision tower (e.g. ``"model.vision_tower"``), None when there is none."""
    return _shallowest(model, TOWER_NAMES)


def projector_name(model: torch.nn.Module) -> str | None:
    """The module name of ``model``'s projector (e.g. ``"model.multi_modal_projector"``), None when there is none."""
    return _shallowest(model, PROJECTOR_NAMES)


def _inside(name: str, module: str | None) -> bool:
    return module is not None and (name == module or name.startswith(module + "."))


def check_option(model: Any, train_vision_tower: bool) -> bool:
    """Validate ``train_vision_tower`` for ``model``; return whether ``model`` is a vision-language model.

    Raises:
        ValueError: ``train_vision_tower=True`` for a text-only model, or a vision-language model whose tower is not
            found by name (naming the fix).
    """
    vision = is_vision_model(model)
    if not vision:
        if train_vision_tower:
            raise ValueError(
                f"`train_vision_tower=True` applies to vision-language models, and {type(model).__name__} is "
                "text-only (its config has no `vision_config`): remove `train_vision_tower`, or give a vision-language "
                "model (e.g. model: tiny-vl)."
            )
        return False
    if not train_vision_tower and tower_name(model) is None:
        raise ValueError(
            f"{type(model).__name__} is a vision-language model but none of its modules is named like a vision tower "
            f"({', '.join(TOWER_NAMES)}), so it cannot be frozen: set `train_vision_tower=True` to train every weight."
        )
    return True


def freeze_tower(model: torch.nn.Module) -> int:
    """Freeze the vision tower's parameters (adapters in it included), the projector's excepted when it lies inside
    the tower (Qwen2-VL's merger); return the number of values frozen."""
    tower, projector = tower_name(model), projector_name(model)
    frozen = 0
    for name, param in model.named_parameters():
        if _inside(name, tower) and not _inside(name, projector) and param.requires_grad:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def _as_regex(spec: Any) -> str | None:
    """peft's ``exclude_modules`` (a regex matched in full, or names matched as the key or its dotted suffix) as one
    regex."""
    if not spec:
        return None
    if isinstance(spec, str):
        return spec
    return "|".join(rf"(?:.*\.)?{re.escape(name)}" for name in spec)


def adapt_peft_config(model: torch.nn.Module, config: Any, train_vision_tower: bool) -> Any:
    """``config`` (a ``peft.PeftConfig``, modified in place and returned) for a vision-language ``model``: the tower
    excluded from the adapters unless ``train_vision_tower``; the projector in ``modules_to_save`` when the config
    sets none (module docstring)."""
    tower, projector = tower_name(model), projector_name(model)
    if hasattr(config, "modules_to_save") and config.modules_to_save is None and projector is not None:
        config.modules_to_save = [projector]
    if not train_vision_tower and tower is not None and hasattr(config, "exclude_modules"):
        ours = rf"{re.escape(tower)}(?:\..*)?"
        if projector is not None and _inside(projector, tower):  # a projector inside the tower keeps its adapters
            ours = rf"(?!{re.escape(projector)}(?:\.|$)){ours}"
        theirs = _as_regex(config.exclude_modules)
        config.exclude_modules = ours if theirs is None else f"(?:{theirs})|(?:{ours})"
    return config


def check_tower_trains(model: torch.nn.Module) -> None:
    """Under peft with ``train_vision_tower=True``: some parameter in the tower must train.

    Raises:
        ValueError: naming the tower and the fix.
    """
    tower = tower_name(model)
    if tower is None or any(_inside(n, tower) and p.requires_grad for n, p in model.named_parameters()):
        return
    tower = tower_name(_base(model))  # named as in the transformers model, without peft's prefix
    raise ValueError(
        f"`train_vision_tower=True`, but the peft config puts no adapter in the vision tower ({tower}): its "
        "`target_modules` match none of the tower's layers. Use target_modules: all-linear (or names of the tower's "
        f"linear layers), add {tower.rpartition('.')[2]!r} to `modules_to_save` to train the whole tower, or set "
        "`train_vision_tower=False`."
    )


def log_vision_parts(model: torch.nn.Module) -> None:
    """Log (rank 0) how many of the tower's and the projector's values train."""
    tower, projector = tower_name(model), projector_name(model)
    for what, name in (("vision tower", tower), ("projector", projector)):
        if name is None:
            continue
        inside = [(n, p) for n, p in model.named_parameters() if _inside(n, name)]
        if what == "vision tower":
            inside = [(n, p) for n, p in inside if not _inside(n, projector)]
        trainable = sum(p.numel() for _, p in inside if p.requires_grad)
        rank_zero_info(f"[lit_trainer] {what} {name}: {trainable:,} of {sum(p.numel() for _, p in inside):,} train")


def tower_block_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the modules inside ``model``'s vision tower: under FSDP2 they are left out of the default
    blocks (``_no_split_modules`` names LLaVA's CLIP layers), so the tower is sharded with the root group."""
    tower = tower_name(model)
    return {type(m).__name__ for n, m in model.named_modules() if _inside(n, tower) and n != tower}


def _base(model: Any) -> Any:
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def image_free_term(model: Any) -> Tensor | None:
    """Zero times the image features of a blank image (module docstring), for a micro-batch without images, computed
    after the batch's forward (under FSDP2 the root group, which holds the tower, is then still gathered); None when
    nothing in the vision path trains, or when the model has no ``get_image_features`` / image size to build the blank
    image from."""
    base = _base(model)
    tower, projector = tower_name(base), projector_name(base)
    trains = any(p.requires_grad for n, p in base.named_parameters() if _inside(n, tower) or _inside(n, projector))
    vision = getattr(base.config, "vision_config", None)
    size, channels = getattr(vision, "image_size", None), getattr(vision, "num_channels", 3)
    if not trains or size is None or not hasattr(base, "get_image_features"):
        return None
    param = next(p for p in base.parameters() if p.is_floating_point())
    blank = torch.zeros(1, channels, size, size, device=param.device, dtype=param.dtype)
    out = base.get_image_features(pixel_values=blank)
    features = getattr(out, "pooler_output", out)
    features = features if isinstance(features, (list, tuple)) else [features]
    return sum(f.float().sum() for f in features) * 0.0
