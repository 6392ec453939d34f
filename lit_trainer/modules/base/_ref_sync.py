"""TR-DPO reference-model synchronisation, shared by :class:`~lit_trainer.modules.dpo.DPOModule` and
:class:`~lit_trainer.modules.grpo.GRPOModule` (TRL's ``sync_ref_model`` / ``ref_model_mixup_alpha`` /
``ref_model_sync_steps``).

After every ``ref_model_sync_steps``-th optimizer step the reference parameters become ``(1 - alpha) * ref + alpha *
policy``, in place (buffers untouched), right after the optimizer step and before any callback's
``on_train_batch_end``, so a checkpoint written at that step holds the synced reference. The reference is a submodule
(``ref_model.*`` in the state dict), so resuming restores it exactly. Under ``ModelParallelStrategy`` the policy and
the reference are sharded alike, and each rank mixes its own DTensor shards elementwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override


def check_ref_sync_options(owner: str, sync: bool, alpha: float, steps: int, *, is_peft: bool) -> None:
    """Validate the TR-DPO options of ``owner`` (the module's class name, used in the messages).

    Raises:
        ValueError: ``alpha`` outside [0, 1], ``steps < 1``, or ``sync`` with a peft-wrapped policy (whose reference is
            the policy with its adapters disabled: there is no separate network to mix into).
    """
    if not 0.0 <= alpha <= 1.0 or steps < 1:
        raise ValueError(
            f"`{owner}(ref_model_mixup_alpha={alpha}, ref_model_sync_steps={steps})` is invalid: alpha must be in "
            "[0, 1] and the period >= 1 (e.g. 0.6 and 512)."
        )
    if sync and is_peft:
        raise ValueError(
            f"`{owner}(sync_ref_model=True)` with `peft_config`/`adapter_path` is invalid: the reference is the "
            "policy network with its adapters disabled, which TR-DPO cannot mix into. Turn sync_ref_model off, or "
            "fine-tune all weights."
        )


class ReferenceSyncMixin:
    """``sync_reference_model`` and the optimizer-step hook that calls it (mixed into a ``LightningModule`` whose
    hyperparameters hold ``sync_ref_model``, ``ref_model_mixup_alpha`` and ``ref_model_sync_steps``, with
    ``self.model`` and ``self.ref_model``)."""

    _sync_params: tuple[list[Tensor], list[Tensor]] | None = None

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        step = self.trainer.global_step + 1  # Lightning counts this step once the hook returns
        if self.hparams.sync_ref_model and step % self.hparams.ref_model_sync_steps == 0:
            self.sync_reference_model()  # before any callback's on_train_batch_end: checkpoints see the synced ref

    @torch.no_grad()
    def sync_reference_model(self, alpha: float | None = None) -> None:
        """TR-DPO: ``θ_ref ← (1−α)θ_ref + αθ_policy`` for every parameter; buffers untouched.

        Args:
            alpha: the mixing weight (default: ``ref_model_mixup_alpha``).

        Raises:
            ValueError: without a reference model, or when its parameter names do not mirror the policy's.
        """
        if not isinstance(self.ref_model, torch.nn.Module):
            raise ValueError("`sync_reference_model` needs a reference model, but there is none (or it was released).")
        if self._sync_params is None:
            policy, ref = dict(self.model.named_parameters()), dict(self.ref_model.named_parameters())
            if policy.keys() != ref.keys():
                raise ValueError(
                    f"The reference model's parameters do not mirror the policy's (e.g. "
                    f"{sorted(policy.keys() ^ ref.keys())[:3]}): TR-DPO mixes them by name."
                )
            self._sync_params = ([ref[n] for n in policy], [policy[n].detach() for n in policy])
        alpha = self.hparams.ref_model_mixup_alpha if alpha is None else alpha
        ref_params, policy_params = self._sync_params
        torch._foreach_mul_(ref_params, 1.0 - alpha)
        torch._foreach_add_(ref_params, policy_params, alpha=alpha)

    def reset_reference_sync(self) -> None:
        """Forget the cached parameter lists (call at fit start: ``configure_model`` may have replaced them)."""
        self._sync_params = None
