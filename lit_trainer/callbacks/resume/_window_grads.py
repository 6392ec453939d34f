"""The gradients of an accumulation window in progress, for checkpoints written inside the window.

Lightning's ``val_check_interval`` counts micro-batches, so a validation (and the checkpoint it triggers) can fall
between two micro-batches of one optimizer step. The optimizer state is then at the last step, but the gradients of
the window's first micro-batches live only in ``param.grad``. Saving them (per rank: under DDP they are not yet
synchronised) and putting them back before the next backward lets the resumed window add the remaining micro-batches
onto exactly the same sums, so the step is bit-identical.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lit_trainer.core.lightning_namespace import LightningNamespace


def window_in_progress(trainer: pl.Trainer) -> bool:
    """True when micro-batches have run backward since the last optimizer step (Lightning's windows are aligned on
    the epoch's batch index; the epoch's last batch always steps)."""
    if not trainer.lightning_module.automatic_optimization:
        return False
    progress = trainer.fit_loop.epoch_loop.batch_progress
    done = progress.current.processed
    final = progress.is_last_batch or done >= trainer.num_training_batches
    return done % trainer.accumulate_grad_batches != 0 and not final


def grads_are_local(trainer: pl.Trainer, ns: LightningNamespace) -> bool:
    """Whether each rank's ``param.grad`` holds its whole accumulated gradient (one device or DDP), so it can be saved
    and restored by parameter name; sharded strategies keep gradient shards that this does not handle.

    ``ns`` is the namespace of the trainer's Lightning package: a ``pytorch_lightning`` trainer's strategies are not
    instances of the ``lightning.pytorch`` classes."""
    strategy = trainer.strategy
    local = (ns.SingleDeviceStrategy, ns.DDPStrategy)
    return isinstance(strategy, local) and not strategy.handles_gradient_accumulation


def mid_window_validation_error(
    strategy: str, local_grads: bool, accumulate: int, val_check_batch: Any, validating: bool
) -> str | None:
    """Why a run cannot resume exactly from its validation checkpoints, or None.

    Under a strategy whose gradients are sharded or held by the strategy (FSDP, DeepSpeed), the gradients of a window
    in progress are not saved, so a validation between two micro-batches of one step (``val_check_batch`` counts
    micro-batches) writes checkpoints that lose the window's first micro-batches.
    """
    if local_grads or not validating or accumulate <= 1 or not isinstance(val_check_batch, int):
        return None
    if val_check_batch % accumulate == 0:
        return None
    return (
        f"ExactResume: validation every {val_check_batch} micro-batches falls inside the accumulation windows of "
        f"{accumulate} micro-batches, and under {strategy} the gradients of a window in progress cannot be saved, "
        "so a run resumed from a checkpoint written at such a validation would not be exact. Set "
        f"`val_check_interval` to a multiple of `accumulate_grad_batches` ({accumulate}), or drop ExactResume."
    )


def collect_window_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter gradient accumulated so far in the window."""
    return {name: p.grad.detach().to("cpu", copy=True) for name, p in module.named_parameters() if p.grad is not None}


def restore_window_grads(module: torch.nn.Module, grads: dict[str, Any]) -> None:
    """Put saved window gradients back into ``param.grad`` (the next backward accumulates onto them).

    Raises:
        ValueError: a saved gradient names a parameter the module does not have (another model).
    """
    params = dict(module.named_parameters())
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise ValueError(
            f"ExactResume: the checkpoint holds window gradients for unknown parameters {unknown[:5]}: "
            "resume with the model the checkpoint was written for."
        )
    for name, grad in grads.items():
        params[name].grad = grad.to(params[name].device)
