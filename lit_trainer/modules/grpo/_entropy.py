"""The entropy options of :class:`~lit_trainer.modules.grpo.GRPOModule`: the entropy bonus with its adaptive
coefficient (TRL 1.16's ``entropy_coef``, ``use_adaptive_entropy``; Skywork-OR1), and the cross-rank entropy pool of
``top_entropy_quantile``.

Bonus. The objective is ``L_policy - c * H`` with ``H`` the mean token entropy (with gradient) of each micro-batch
over the tokens the policy term trains on, averaged over the optimizer step's micro-batches and the ranks, whatever the
loss type's normaliser: the reference divides each micro-batch's mean by the step's micro-steps (its ``GA_cur``) and
DDP averages the ranks, so :meth:`EntropyControl.take_bonus` divides by ``micro-steps x world size`` (the module
returns ``contribution x N x W`` to Lightning).

Adaptive coefficient. Every micro-step adds ``[sum H m, sum m]`` (no grad) to a window; at the optimizer step's last
micro-step the window is summed over ranks, ``H_step = sum / max(1, count)``, and the coefficient moves by ``delta``
(up when ``H_step <= entropy_target``, down otherwise, clamped to ``[entropy_coef_min, entropy_coef_max]``). The
coefficient applied during a step is the one from the end of the previous step, and only while the last measured
``H_step <= entropy_target`` (``inf`` before the first measurement: no bonus in the first step). The coefficient, the
last measurement and every rank's window are checkpoint state (floats and tensors), so a resumed run is bit-exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_trainer.losses.grpo_masks import masked_mean_entropy

_PAD = -1e9  # below any entropy: marks the padding of a rank's pool


def adaptive_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """The coefficient after one optimizer step: ``min(coef + delta, max)`` if ``entropy <= target``, else
    ``max(coef - delta, min)``.

    Example:
        >>> adaptive_entropy_coef(0.01, 0.1, target=0.2, delta=0.005, coef_min=0.0, coef_max=1.0)
        0.015
    """
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


@dataclass
class EntropyControl:
    """Entropy-bonus state of one GRPOModule (see the module docstring).

    Attributes:
        coef: the current coefficient (``entropy_coef`` at the start).
        adaptive: ``use_adaptive_entropy``.
        target, delta, coef_min, coef_max: the adaptive schedule's options.
        last_entropy: the last step's measured entropy over all ranks (``inf`` before the first).
        window: this rank's ``[sum H m, sum m]`` of the current optimizer step (None at a step's start).
        pending: the current micro-batch's mean entropy, with gradient, until :meth:`take_bonus`.
    """

    coef: float
    adaptive: bool
    target: float
    delta: float
    coef_min: float
    coef_max: float
    last_entropy: float = math.inf
    window: Tensor | None = None
    pending: Tensor | None = None

    @property
    def enabled(self) -> bool:
        """Whether the bonus is part of the loss (a non-zero coefficient, or the adaptive schedule)."""
        return self.coef != 0.0 or self.adaptive

    def applied_coef(self) -> float:
        """The coefficient applied in the current step (adaptive: 0 while the last entropy is above the target)."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def observe(self, entropies: Tensor, mask: Tensor) -> None:
        """Record one micro-batch: its mean entropy over ``mask`` (with grad) and, adaptive, the window sums."""
        self.pending = masked_mean_entropy(entropies, mask)
        if self.adaptive:
            mask_f = mask.to(entropies.dtype)
            stats = torch.stack([(entropies * mask_f).sum(), mask_f.sum()]).detach()
            self.window = stats if self.window is None else self.window + stats

    def take_bonus(self, micro_steps_times_world: int) -> Tensor | float:
        """``-c * H / (micro-steps x world)`` of the pending micro-batch (0 when disabled), then forget it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return 0.0
        return -self.applied_coef() * pending / micro_steps_times_world

    def end_step(self, reduce_sum: Callable[[Tensor], Tensor]) -> None:
        """At the optimizer step's last micro-step: measure the step's entropy over ranks and move the coefficient."""
        if not self.adaptive or self.window is None:
            return
        stats, self.window = reduce_sum(self.window), None
        entropy = float(stats[0] / stats[1].clamp(min=1.0))
        self.coef = adaptive_entropy_coef(
            self.coef, entropy, target=self.target, delta=self.delta, coef_min=self.coef_min, coef_max=self.coef_max
        )
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, Any]:
        """Floats and a CPU tensor (or None): checkpoint-safe with ``weights_only=True``."""
        window = None if self.window is None else self.window.detach().cpu()
        return {"coef": float(self.coef), "last_entropy": float(self.last_entropy), "window": window}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
        window = state.get("window")
        self.window = None if window is None else window.to(device)


def gather_entropy_pool(
    entropies: Tensor, mask: Tensor, world_size: int, all_gather: Callable[[Tensor], Tensor]
) -> Tensor:
    """The masked entropies of every rank's micro-batch, as one 1-D tensor (rank order).

    Ranks hold different numbers of tokens: each pads its own to the longest with a sentinel below any entropy, the
    padded tensors are gathered (``all_gather`` returns ``(world, L)``) and the sentinels dropped.
    """
    local = entropies[mask.bool()].detach().float()
    if world_size == 1:
        return local
    longest = int(all_gather(torch.tensor([local.numel()], device=local.device)).max())
    padded = torch.full((longest,), _PAD, device=local.device)
    padded[: local.numel()] = local
    gathered = all_gather(padded).reshape(-1)
    return gathered[gathered != _PAD]
