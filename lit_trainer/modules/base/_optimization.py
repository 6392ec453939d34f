"""The optimizer mixin of :class:`~lit_trainer.modules.base.BaseModule`: the default AdamW (fused when possible) and
learning-rate schedule, the learning rate of each step, and gradient clipping with the pre-clipping norm logged."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from typing_extensions import override

from lit_trainer.modules.base import _sharding
from lit_trainer.modules.base._schedules import build_schedule

_NO_DECAY = ("bias", "norm")


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
        decays = [p.ndim > 1 and not any(k in n.lower() for k in _NO_DECAY) for n, p in named]
        decay = [p for (_, p), d in zip(named, decays) if d]
        no_decay = [p for (_, p), d in zip(named, decays) if not d]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=self.hparams.learning_rate,
            fused=fused_adamw_supported([p for _, p in named]) or None,
        )

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
