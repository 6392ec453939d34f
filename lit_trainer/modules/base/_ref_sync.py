"""The Lightning hook of TR-DPO reference-model synchronisation, shared by the modules that hold a
:class:`~lit_trainer.modules.reference.ReferenceModel` as ``self.reference`` (DPO, KTO, GRPO, RLOO; TRL's
``sync_ref_model`` / ``ref_model_mixup_alpha`` / ``ref_model_sync_steps``).

After every ``ref_model_sync_steps``-th optimizer step the reference parameters become ``(1 - alpha) * ref + alpha *
policy``, in place (buffers untouched), right after the optimizer step and before any callback's
``on_train_batch_end``, so a checkpoint written at that step holds the synced reference. The reference is a submodule
(``ref_model.*`` in the state dict), so resuming restores it exactly. The mixing itself is
:meth:`~lit_trainer.modules.reference.ReferenceModel.sync`; this mixin only calls it at the right time.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override


class ReferenceSyncMixin:
    """``sync_reference_model`` and the optimizer-step hook that calls it (mixed into a ``LightningModule`` with a
    ``self.reference``: a :class:`~lit_trainer.modules.reference.ReferenceModel`)."""

    reference: Any

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Lightning counts this step once the hook returns; before any callback's on_train_batch_end, so
        # checkpoints see the synced reference
        self.reference.maybe_sync(self.trainer.global_step + 1)

    def sync_reference_model(self, alpha: float | None = None) -> None:
        """TR-DPO: ``θ_ref ← (1−α)θ_ref + αθ_policy`` for every parameter; buffers untouched
        (:meth:`~lit_trainer.modules.reference.ReferenceModel.sync`).

        Args:
            alpha: the mixing weight (default: ``ref_model_mixup_alpha``).

        Raises:
            ValueError: without a reference model, or when its parameter names do not mirror the policy's.
        """
        self.reference.sync(alpha)

    def reset_reference_sync(self) -> None:
        """Forget the cached parameter lists (call at fit start: ``configure_model`` may have replaced them)."""
        self.reference.reset_sync()
