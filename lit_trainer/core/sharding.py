"""FSDP2 sharding of the modules' networks under Lightning's ``ModelParallelStrategy`` (``docs/sharding.md``).

Lightning's ``ModelParallelStrategy`` builds a device mesh, sets it as ``LightningModule.device_mesh`` and calls
``configure_model``; there :meth:`BaseModule.configure_model` calls :func:`shard_model` on the policy (and on a
frozen reference model): ``torch.distributed.fsdp.fully_shard`` on every transformer block (the classes named by the
HF model's ``_no_split_modules``, or by ``shard_blocks``) and then on the root, over the mesh's data-parallel
dimension. Parameters, gradients and optimizer state become ``DTensor`` shards (1/W of each tensor per rank); a
block's full weights exist only while it runs (all-gathered before its forward/backward, freed after). Gradients are
reduce-scattered with a mean over the ranks (as DDP's all-reduce), so the modules' token-exact scaling is unchanged.

Only data parallelism is applied: a mesh with ``tensor_parallel_size > 1`` is refused (tensor parallelism needs a
per-architecture plan).

It lives in ``core`` because the callbacks need its tensor helpers too (BEMA's and HFExport's full state dicts,
BestCheckpoint's reload of a sharded model), and callbacks never import ``lit_trainer.modules``.

A peft (LoRA) model is wrapped first and sharded after: the blocks hold their frozen base weights and their trainable
adapters in one FSDP2 group (FSDP2 reduce-scatters only the gradients that exist), and the root group is the wrapped
transformers model (:func:`shard_root`), whose forward both the training step and ``generate`` call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

import torch
from torch import Tensor

ParamDtype = Literal["float32", "bfloat16", "float16"]
# strategies whose (reduced) gradients are in ``param.grad`` after ``backward``: plain tensors, or FSDP2's DTensor
# shards; the modules clip and rescale those themselves
LOCAL_GRAD_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "ModelParallelStrategy")
# subclasses of those that keep the gradients in their own engine (Lightning's DeepSpeedStrategy is a DDPStrategy)
_ENGINE_GRAD_STRATEGIES = ("DeepSpeedStrategy",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert set(_DTYPES) == set(get_args(ParamDtype)), "ParamDtype and _DTYPES list the same dtypes"


def data_parallel_mesh(mesh: Any) -> Any:
    """The mesh's data-parallel dimension (the whole mesh when it is one-dimensional).

    Raises:
        ValueError: when the mesh also has a tensor-parallel dimension larger than 1.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"ModelParallelStrategy(tensor_parallel_size={mesh['tensor_parallel'].size()}) is not "
            "supported: lit_trainer modules shard over the data-parallel dimension only (FSDP2). Use "
            "`tensor_parallel_size=1` and `data_parallel_size=<number of devices>`."
        )
    return mesh["data_parallel"] if "data_parallel" in names else mesh


def block_class_names(model: torch.nn.Module, override: Iterable[str] | None = None) -> set[str]:
    """Class names of the transformer blocks to shard one by one: ``override``, else the model's
    ``_no_split_modules`` (what HF's ``device_map`` never splits: the decoder layers).

    Raises:
        ValueError: when no block class is known, or a named class is absent from the model.
    """
    names = set(override) if override is not None else set(getattr(model, "_no_split_modules", None) or ())
    present = {type(m).__name__ for m in model.modules()}
    if not names:
        raise ValueError(
            f"{type(model).__name__} names no transformer block class (`_no_split_modules` is empty): "
            "pass `shard_blocks=[<decoder layer class name>]` to the module."
        )
    if not names & present:
        raise ValueError(
            f"`shard_blocks={sorted(names)}`: no module of {type(model).__name__} has one of these "
            f"classes; e.g. one of {sorted(n for n in present if 'Layer' in n or 'Block' in n)}."
        )
    return names & present


def fsdp_policies(param_dtype: ParamDtype | None, cpu_offload: bool) -> dict[str, Any]:
    """``fully_shard`` keyword arguments: a mixed-precision policy (compute in ``param_dtype``, gradients reduced in
    float32) and a CPU offload policy (parameters, gradients and optimizer state kept on the CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict[str, Any] = {}
    if param_dtype is not None:
        if param_dtype not in _DTYPES:
            raise ValueError(
                f"`shard_param_dtype={param_dtype!r}` is invalid: use one of {get_args(ParamDtype)} or None."
            )
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def shard_root(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``fully_shard`` takes as the root group: the model itself, or for a peft model (duck-typed:
    ``peft_config`` and ``get_base_model``) the transformers model it wraps. peft's ``generate`` calls the wrapped
    model's ``generate``, which runs the wrapped model's forward, never the peft wrapper's: a root group on the wrapper
    would not be gathered there."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def shard_model(model: torch.nn.Module, mesh: Any, blocks: set[str], **policies: Any) -> torch.nn.Module:
    """``fully_shard`` every module whose class name is in ``blocks``, then the root (:func:`shard_root`: it keeps
    the rest: the embeddings, the final norm, the head, tied weights together).

    FSDP2 keeps a root's parameters gathered after its forward, for the backward that follows; a frozen network
    (the reference model: no backward) reshards its root after every forward instead, so its full embeddings and head
    do not stay in memory.
    """
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, **policies)
    frozen = not any(p.requires_grad for p in model.parameters())
    fully_shard(shard_root(model), mesh=mesh, reshard_after_forward=True if frozen else None, **policies)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or, for a peft model, the model it wraps) was already passed to ``fully_shard``
    (``configure_model`` may run more than once)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or isinstance(shard_root(model), FSDPModule)


def is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (the tensor itself otherwise): elementwise updates work shard by shard."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def full(tensor: Tensor) -> Tensor:
    """The full value of a ``DTensor`` (a collective: every rank must call it), the tensor itself otherwise."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, Tensor]:
    """The full (unsharded) state dict of ``model`` on the CPU. Sharded: a collective every rank must call, and only
    rank 0 receives the tensors (the others get an empty dict, so no rank but one holds a full copy).
    ``trainable_only``: leave the frozen parameters out (a LoRA export gathers the adapters, not the base)."""
    if not any(is_dtensor(p) for p in model.parameters()):
        state = model.state_dict()
        if trainable_only:
            frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def shard_like(full_value: Tensor, like: Tensor) -> Tensor:
    """This rank's part of the full tensor ``full_value``, as the ``DTensor`` ``like`` is split (cut locally, no
    communication: every rank holds the full value); ``full_value`` itself when ``like`` is a plain tensor."""
    if not is_dtensor(like):
        return full_value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full_value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def load_full_state_dict(module: torch.nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
    """Load full (unsharded) tensors into ``module``, whose parameters may be FSDP2 shards: every rank cuts its own
    shards out of ``state`` (which every rank holds); plain entries load as they are."""
    current = module.state_dict()
    module.load_state_dict(
        {k: shard_like(v, current[k]) if k in current else v for k, v in state.items()}, strict=strict
    )


def strategy_is(strategy: Any, names: Iterable[str]) -> bool:
    """Whether ``strategy`` is (a subclass of) one of the strategy classes ``names`` (either lightning namespace)."""
    return bool({cls.__name__ for cls in type(strategy).__mro__} & set(names))


def has_local_grads(strategy: Any) -> bool:
    """Whether ``strategy`` leaves the reduced gradients in ``param.grad`` after ``backward`` (one of
    :data:`LOCAL_GRAD_STRATEGIES`, DeepSpeed excluded although it subclasses ``DDPStrategy``): the modules then clip
    and rescale them themselves."""
    return strategy_is(strategy, LOCAL_GRAD_STRATEGIES) and not strategy_is(strategy, _ENGINE_GRAD_STRATEGIES)


def check_strategy(trainer: Any, max_grad_norm: float | None) -> None:
    """Refuse the strategies under which the modules would silently lose a feature.

    * ``FSDPStrategy`` (FSDP1): the modules shard with FSDP2 in ``configure_model``; FSDP1's wrapping, clipping and
      checkpoints are another path, untested here (it needs a GPU): use ``ModelParallelStrategy``.
    * Any strategy whose clipping the modules do not do themselves (DeepSpeed clips inside its engine) with
      ``max_grad_norm`` set but no ``Trainer(gradient_clip_val=...)``: Lightning would not clip at all.

    Raises:
        ValueError: naming the strategy and the fix.
    """
    strategy = trainer.strategy
    name = type(strategy).__name__
    if strategy_is(strategy, ("FSDPStrategy",)):
        raise ValueError(
            f"{name} (FSDP1) is not supported by lit_trainer modules: use "
            "`lightning.pytorch.strategies.ModelParallelStrategy(data_parallel_size=<devices>, "
            "tensor_parallel_size=1)`, under which the modules shard themselves with FSDP2."
        )
    if max_grad_norm and not has_local_grads(strategy) and not trainer.gradient_clip_val:
        raise ValueError(
            f"`max_grad_norm={max_grad_norm}` cannot be applied by the module under {name} (the strategy "
            "clips gradients itself, only with the Trainer's value): set "
            f"`Trainer(gradient_clip_val={max_grad_norm})`, or `max_grad_norm=None` to train unclipped."
        )
