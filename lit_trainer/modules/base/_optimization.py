"""The optimizer mixin of :class:`~lit_trainer.modules.base.BaseModule`: the default AdamW (fused when possible, or
bitsandbytes' 8-bit / paged AdamW) and learning-rate schedule, the learning rate of each step, and gradient clipping
with the pre-clipping norm logged.

``optim`` names the default optimizer as the HF Trainer does. The bitsandbytes ones (``adamw_8bit``,
``paged_adamw_8bit``, ``paged_adamw_32bit``) are ``bitsandbytes.optim.AdamW`` with ``optim_bits`` 8 or 32 and
``is_paged``, with the HF Trainer's defaults (betas 0.9/0.999, eps 1e-8), so their numbers are bitsandbytes' own:

- 8-bit state is block-wise quantized (blocks of 256 values with their own scale, dynamic 8-bit code): about a quarter
  of the 32-bit state's memory. Tensors with fewer than 4,096 values (bitsandbytes' ``min_8bit_size``) keep 32-bit
  state, which is negligible memory. Embedding weights keep 32-bit state as in the HF Trainer (quantized state on
  embeddings is known to destabilise training); here through a parameter group of their own with ``optim_bits`` 32,
  not bitsandbytes' process-wide override registry (which HF uses, and which keys parameters by ``id`` across runs).
- Paged state lives in CUDA unified memory and is evicted to CPU memory under pressure; on a CPU there is nothing to
  page and bitsandbytes runs them as the unpaged optimizers.
- The state (uint8 tensors, their scales and code books) is part of ``optimizer.state_dict()``, so checkpoints carry
  it, load with ``weights_only=True``, and a resume continues bit-exactly on CPU (tests/test_qlora.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any, Literal, get_args

import torch
from typing_extensions import override

from lit_trainer.core import sharding as _sharding
from lit_trainer.modules.base._schedules import build_schedule

_NO_DECAY = ("bias", "norm")
OptimName = Literal["adamw_torch_fused", "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"]
"""The default optimizer's names (the HF Trainer's ``optim`` values for the same optimizers)."""
TORCH_OPTIMS = ("adamw_torch_fused", "adamw_torch")


def check_optim(optim: str, optimizer: Any) -> None:
    """Refuse an unknown ``optim``, or a non-default one together with a custom ``optimizer`` (one would be ignored).

    Raises:
        ValueError: naming the value and the fix.
    """
    if optim not in get_args(OptimName):
        raise ValueError(f"`optim={optim!r}` is not a known optimizer: choose one of {get_args(OptimName)}.")
    if optimizer is not None and optim != "adamw_torch_fused":
        raise ValueError(
            f"`optim={optim!r}` and a custom `optimizer` are both given: the custom optimizer would be used and "
            "`optim` ignored. Keep one: remove `optimizer`, or leave `optim` at its default."
        )


@functools.cache
def _bnb_adamw() -> type:
    """``bitsandbytes.optim.AdamW`` that reads ``optim_bits`` from a parameter group (a group of embeddings keeps
    32-bit state under an 8-bit optimizer)."""
    from lit_trainer.quantization import require_bitsandbytes

    bnb = require_bitsandbytes("`optim` adamw_8bit / paged_adamw_8bit / paged_adamw_32bit")

    class AdamW(bnb.optim.AdamW):
        def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
            config = super().get_config(gindex, pindex, group)
            if "optim_bits" in group:
                config["optim_bits"] = group["optim_bits"]
            return config

    AdamW.__qualname__ = AdamW.__name__ = "BnbAdamW"
    return AdamW


def build_adamw(optim: str, groups: list[dict[str, Any]], lr: float, fused: bool) -> torch.optim.Optimizer:
    """The AdamW that ``optim`` names over parameter ``groups`` (see the module docstring)."""
    if optim in TORCH_OPTIMS:
        return torch.optim.AdamW(groups, lr=lr, fused=(optim == "adamw_torch_fused" and fused) or None)
    bits = 8 if optim.endswith("8bit") else 32
    return _bnb_adamw()(groups, lr=lr, optim_bits=bits, is_paged=optim.startswith("paged"))


def fused_adamw_supported(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel takes every parameter: floating-point parameters, plain or FSDP2 ``DTensor``
    shards (the update is elementwise; torch 2.13 runs the fused kernel on the local shards), on device types that
    have the kernel (CPU, CUDA, ...).

    The fused kernel computes the same update as the per-tensor default (equal to float rounding, ~1e-7) in one pass
    over all tensors; on CPU it is ~3.5x faster for small models (``benchmarks/sft_throughput.py``). The HF Trainer
    uses it by default too (``optim="adamw_torch_fused"``).
    """
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - private helper moved
        devices = {"cpu", "cuda"}
    return bool(params) and all(
        (type(p) is torch.nn.Parameter or _sharding.is_dtensor(p))
        and p.device.type in devices
        and torch.is_floating_point(p)
        for p in params
    )


class OptimizationMixin:
    """Optimizer, scheduler and clipping hooks of :class:`~lit_trainer.modules.base.BaseModule` (mixed into a
    ``LightningModule``; reads ``self._optimizer_fn``, ``self._scheduler_fn`` and the hyperparameters)."""

    def trainable_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        """Named parameters that receive gradients (frozen ones, e.g. a reference model, are excluded)."""
        return ((n, p) for n, p in self.named_parameters() if p.requires_grad)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        named = list(self.trainable_parameters())
        if not named:
            raise ValueError("The module has no trainable parameter: nothing to optimize.")
        optimizer = self.create_optimizer(named)
        if self._scheduler_fn is not None:
            scheduler = self._scheduler_fn(optimizer)
        else:
            hp = self.hparams
            scheduler = build_schedule(
                optimizer,
                hp.scheduler,
                hp.warmup_steps,
                max(1, int(self.trainer.estimated_stepping_batches)),
                hp.scheduler_kwargs,
            )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def create_optimizer(self, named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        """The optimizer over ``named`` (the :meth:`trainable_parameters`, in order): the ``optimizer`` callable when
        one was given, else AdamW with ``learning_rate`` and ``weight_decay`` (none on biases, norms and 1-D
        parameters). Override it to build another optimizer or parameter groups (``docs/customizing.md``); the
        learning-rate schedule is then applied to the optimizer it returns."""
        if self._optimizer_fn is not None:
            return self._optimizer_fn([p for _, p in named])
        optim = self.hparams.get("optim", "adamw_torch_fused")
        decays = [p.ndim > 1 and not any(k in n.lower() for k in _NO_DECAY) for n, p in named]
        groups = [
            {"params": [p for (_, p), d in zip(named, decays) if d], "weight_decay": self.hparams.weight_decay},
            {"params": [p for (_, p), d in zip(named, decays) if not d], "weight_decay": 0.0},
        ]
        if optim.endswith("8bit"):  # HF Trainer: embeddings keep 32-bit state under an 8-bit AdamW
            embeddings = {id(m.weight) for m in self.modules() if isinstance(m, torch.nn.Embedding)}
            groups += [
                {**g, "params": [p for p in g["params"] if id(p) in embeddings], "optim_bits": 32} for g in groups
            ]
            for group in groups[:2]:
                group["params"] = [p for p in group["params"] if id(p) not in embeddings]
        groups = [g for g in groups if g["params"]]
        fused = fused_adamw_supported([p for _, p in named])
        return build_adamw(optim, groups, self.hparams.learning_rate, fused)

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        # the rate this step uses: Lightning steps the scheduler after this hook and before the step's logs
        self._step_lr = float(optimizer.param_groups[0]["lr"])
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        local_grads = _sharding.has_local_grads(self.trainer.strategy)
        if gradient_clip_algorithm not in (None, "norm") or not local_grads:
            # value clipping, and DeepSpeed (it clips in its engine with the Trainer's value: see `setup`)
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        max_norm = gradient_clip_val if gradient_clip_val is not None else self.hparams.max_grad_norm
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if params:
            # the pre-clipping total norm as a device tensor (no host sync); inf = measure only. On FSDP2's DTensor
            # gradients the norm is reduced over the shards, and `full` makes it a plain tensor for logging. torch's
            # float32 norm, as the HF Trainer (docs/sharding.md, "GRPO sharded against DDP")
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else math.inf)
            self._grad_norm = _sharding.full(norm)
