"""The reference model of a module, in one object: :class:`ReferenceModel`.

DPO, KTO, GRPO and RLOO compare the policy with a reference model. Everything about that reference is here: how it is
built (a frozen in-memory copy of the policy, a separate model, the policy with its LoRA adapters disabled, or none
while the policy itself scores the data for the precompute pass), how a batch gets its reference log-probs (the
batch's precomputed columns, else a no-grad forward), TR-DPO synchronisation (``sync_ref_model``), the precompute
pass and the release of the network afterwards (:mod:`lit_trainer.modules.reference._ref_logps`), eval mode, the
strategy checks and the checkpoint entries.

The network itself stays the host module's ``ref_model`` attribute, so its weights keep their ``ref_model.*``
state-dict keys (old checkpoints load) and the code that reads ``pl_module.ref_model`` works unchanged: the sharding of
``configure_model``, the packing checks, and BEMA's ``update_ref_model``, which writes its averaged weights into that
network's parameters in place (a refresh the TR-DPO parameter lists see, as they hold the same tensors).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lit_trainer.core import sharding as _sharding
from lit_trainer.models import load_model
from lit_trainer.modules.base._peft import AdapterReference
from lit_trainer.modules.reference import _ref_logps

__all__ = ["ReferenceMode", "ReferenceModel", "disable_dropout_in_model"]

ReferenceMode = Literal["copy", "model", "adapters", "policy", "released", "none"]


def disable_dropout_in_model(model: torch.nn.Module) -> None:
    """``p = 0`` on every ``nn.Dropout`` (as TRL), and 0 on float ``attention_dropout`` attributes.

    The second part goes beyond TRL's helper: HF attention layers (Llama, Qwen2, ...) apply ``attention_dropout``
    functionally, not through an ``nn.Dropout``, so TRL leaves it active in training mode.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


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


def check_precompute_options(owner: str, sync: bool, precompute: bool, batch_size: int | None) -> None:
    """Refuse a precomputed reference that keeps changing, and a precompute batch size below 1."""
    if sync and precompute:
        raise ValueError(
            f"`{owner}(sync_ref_model=True, precompute_ref_log_probs=True)` is invalid: a reference that keeps "
            "changing cannot be precomputed. Turn one of them off."
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"`precompute_ref_batch_size={batch_size}` is invalid: use >= 1 or None.")


class ReferenceModel:
    """The reference model of ``host`` (a :class:`~lit_trainer.modules.base.BaseModule`): built, scored, synced,
    precomputed, released and checkpointed here; the network is ``host.ref_model``.

    Named for what every option calls it (``ref_model``, ``sync_ref_model``, ``precompute_ref_log_probs``); it is not
    an ``nn.Module`` itself, so nothing is registered twice and the state-dict keys stay ``ref_model.*``.

    Args:
        host: the module that holds it (reads ``host.model``, ``host.ref_model``, ``host.is_peft``,
            ``host.default_reference()``, ``host.trainer``, ``host.device`` and, for the precompute pass,
            ``host.score(model, batch).seq``).
        sync: TR-DPO: after every ``sync_steps``-th optimizer step ``θ_ref ← (1−α)θ_ref + αθ_policy``.
        mixup_alpha: ``α`` of TR-DPO, in [0, 1].
        sync_steps: TR-DPO period in optimizer steps (>= 1).
        precompute: score the data with the reference once at fit start, then free the network.
        precompute_batch_size: rows per batch of that pass (None: the data module's eval batch size).
        cache_dir: directory of the precomputed log-probs (None: next to the dataset's cache files, if any).
        ld_alpha: the LD-DPO weight (part of the precompute cache key).
        data_module: the data module class that carries the precomputed columns (named in the messages).

    Raises:
        ValueError: invalid TR-DPO options, ``sync`` under peft or with ``precompute``, a batch size below 1.

    Example::

        self.reference = ReferenceModel(self, sync=True, mixup_alpha=0.6, sync_steps=512)
        self.reference.build(None)  # a frozen copy of the policy (the policy with adapters disabled under peft)
        ref = self.reference.logps(batch, ("ref_logps",), lambda net: score(net, batch))
    """

    def __init__(
        self,
        host: Any,
        *,
        sync: bool = False,
        mixup_alpha: float = 0.6,
        sync_steps: int = 512,
        precompute: bool = False,
        precompute_batch_size: int | None = None,
        cache_dir: str | None = None,
        ld_alpha: float | None = None,
        data_module: str = "PreferenceDataModule",
    ) -> None:
        name = type(host).__name__
        check_precompute_options(name, sync, precompute, precompute_batch_size)
        check_ref_sync_options(name, sync, mixup_alpha, sync_steps, is_peft=host.is_peft)
        self.host, self.data_module = host, data_module
        self.sync_enabled, self.mixup_alpha, self.sync_steps = bool(sync), float(mixup_alpha), int(sync_steps)
        self.precompute = bool(precompute)
        self.precomputed = _ref_logps.PrecomputedReference(ld_alpha, precompute_batch_size, cache_dir)
        self._built: ReferenceMode = "none"
        self._sync_params: tuple[list[Tensor], list[Tensor]] | None = None

    # ------------------------------------------------------------------------------------------------ the network
    @property
    def network(self) -> Any:
        """The reference network (``host.ref_model``): an ``nn.Module``, an adapters-off view of the policy, or None."""
        return self.host.ref_model

    @property
    def mode(self) -> ReferenceMode:
        """``"copy"`` (frozen in-memory copy of the policy), ``"model"`` (a separate model), ``"adapters"`` (the policy
        with its adapters disabled, or its frozen reference adapter, under peft), ``"policy"`` (no network yet: the
        untrained policy scores the data for the precompute pass), ``"released"`` (freed after that pass) or
        ``"none"`` (no reference)."""
        network = self.network
        if isinstance(network, AdapterReference):
            return "adapters"
        if network is None:
            return "released" if self.precomputed.released else "policy" if self._built == "policy" else "none"
        return self._built

    def build(self, reference: Any, *, disable_dropout: bool = False, trust_remote_code: bool = False) -> None:
        """Set ``host.ref_model`` from the ``ref_model`` option: None (a frozen copy of the policy; under peft the
        policy with its adapters disabled; with ``precompute`` and no peft nothing: the policy scores the data before
        its first update), a path/hub id/preset to load, or a model object (frozen, eval mode).

        Raises:
            ValueError: ``reference`` is the policy object itself.
        """
        host = self.host
        if reference is host.model:
            raise ValueError(
                f"`{type(host).__name__}(ref_model=...)` is the policy object itself: pass a separate model, or None "
                "for a frozen copy."
            )
        if reference is None:
            policy_scores = self.precompute and not host.is_peft
            network, self._built = (None, "policy") if policy_scores else (host.default_reference(), "copy")
        else:
            if isinstance(reference, str):
                reference = load_model(reference, trust_remote_code=trust_remote_code)
            network = reference.eval()
            network, self._built = network.requires_grad_(False), "model"
        host.ref_model = network
        if isinstance(network, torch.nn.Module) and disable_dropout:
            disable_dropout_in_model(network)

    def keep_eval(self) -> None:
        """Put the network back in eval mode (it never runs dropout; call after ``host.train()``)."""
        if self.network is not None:
            self.network.eval()

    # ------------------------------------------------------------------------------------------------- scoring
    def logps(self, batch: dict[str, Tensor], columns: tuple[str, ...], score: Callable[[Any], Tensor]) -> Tensor:
        """The reference's per-sequence log-probs of ``batch``'s rows: its precomputed ``columns`` (concatenated, in
        order) when it has them, else ``score(network)`` without gradients.

        Raises:
            ValueError: when the batch has no precomputed values and the network has been released.
        """
        if columns[0] in batch:
            return torch.cat([batch[c] for c in columns]).to(self.host.device, torch.float32)
        if self.network is None:
            names = "/".join(f"`{c}`" for c in columns)
            raise ValueError(
                f"This batch carries no {names} and the reference model has been released "
                f"(precompute_ref_log_probs=True): feed batches from the {self.data_module} the log-probs were "
                "precomputed for."
            )
        with torch.no_grad():
            return score(self.network)

    # ------------------------------------------------------------------------------------------------- TR-DPO
    def maybe_sync(self, step: int) -> None:
        """:meth:`sync` when TR-DPO is on and ``step`` (optimizer steps done) is a multiple of the period."""
        if self.sync_enabled and step % self.sync_steps == 0:
            self.sync()

    @torch.no_grad()
    def sync(self, alpha: float | None = None) -> None:
        """TR-DPO: ``θ_ref ← (1−α)θ_ref + αθ_policy`` for every parameter, in place; buffers untouched. Under
        ``ModelParallelStrategy`` each rank mixes its own DTensor shards elementwise.

        Args:
            alpha: the mixing weight (default: ``mixup_alpha``).

        Raises:
            ValueError: without a reference network, or when its parameter names do not mirror the policy's.
        """
        if not isinstance(self.network, torch.nn.Module):
            raise ValueError("`sync_reference_model` needs a reference model, but there is none (or it was released).")
        if self._sync_params is None:
            policy, ref = dict(self.host.model.named_parameters()), dict(self.network.named_parameters())
            if policy.keys() != ref.keys():
                raise ValueError(
                    f"The reference model's parameters do not mirror the policy's (e.g. "
                    f"{sorted(policy.keys() ^ ref.keys())[:3]}): TR-DPO mixes them by name."
                )
            self._sync_params = ([ref[n] for n in policy], [policy[n].detach() for n in policy])
        alpha = self.mixup_alpha if alpha is None else alpha
        ref_params, policy_params = self._sync_params
        torch._foreach_mul_(ref_params, 1.0 - alpha)
        torch._foreach_add_(ref_params, policy_params, alpha=alpha)

    def reset_sync(self) -> None:
        """Forget the cached parameter lists (at fit start: ``configure_model`` may have replaced the parameters)."""
        self._sync_params = None

    # --------------------------------------------------------------------------------------- precompute and release
    def precompute_logps(self, splits: Iterable[str], release: bool = True) -> None:
        """Score ``splits`` of the trainer's data module with the reference once, store them with the data, and (with
        ``release``) free the network.

        Raises:
            ValueError: without a data module that can store them, or when the reference is gone (released, or the
                policy has been trained) and the data has none yet.
        """
        datamodule = getattr(self.host.trainer, "datamodule", None)
        if not hasattr(datamodule, "set_reference_logps"):
            raise ValueError(
                f"`{type(self.host).__name__}(precompute_ref_log_probs=True)` stores the reference log-probs with the "
                f"dataset: train with `datamodule={self.data_module}(...)`."
            )
        self.precomputed.ensure(self.host, datamodule, splits)
        if release:
            self.release()

    def release(self) -> None:
        """Free the network after the precompute pass (the adapters-off view holds nothing to free)."""
        self.precomputed.released = True
        if isinstance(self.network, torch.nn.Module):
            self.host.ref_model = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            rank_zero_info(
                f"[lit_trainer] {type(self.host).__name__}: reference log-probs precomputed; the reference model was "
                "freed."
            )

    # ------------------------------------------------------------------------------------------- setup, checkpoints
    def check_strategy(self, strategy: Any) -> None:
        """Refuse strategies the reference was not built for (FSDP1, DeepSpeed) and the precompute pass under
        ``ModelParallelStrategy``."""
        name = type(self.host).__name__
        if not _sharding.has_local_grads(strategy):
            raise ValueError(
                f"{name} runs on one device, under DDP or ModelParallelStrategy (FSDP2); "
                f"{type(strategy).__name__} is not supported: the frozen reference, TR-DPO "
                "and the precompute pass are not sharded by it."
            )
        if self.precompute and _sharding.strategy_is(strategy, ("ModelParallelStrategy",)):
            raise ValueError(
                f"`{name}(precompute_ref_log_probs=True)` is not supported under ModelParallelStrategy: "
                "the precompute pass gives the ranks uneven numbers of batches, and every forward of a "
                "sharded model is a collective. Keep the reference model (it is sharded like the policy; "
                "set precompute_ref_log_probs=False), or precompute under DDP."
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the precomputed log-probs (``dpo_reference_logps``) when there are some."""
        if self.precomputed.entries:
            checkpoint[_ref_logps.CKPT_KEY] = self.precomputed.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the precomputed log-probs; reconcile ``ref_model.*`` weights saved before/after the release (drop
        them when this module has no network; fill them from the network when the checkpoint has none)."""
        self.precomputed.load_state_dict(checkpoint.get(_ref_logps.CKPT_KEY, {}))
        state = checkpoint.get("state_dict", {})
        saved = [k for k in state if k.startswith("ref_model.")]
        if not isinstance(self.network, torch.nn.Module):  # released, or the adapter-disabled policy
            for name in saved:
                del state[name]
        elif not saved:
            state.update({f"ref_model.{k}": v for k, v in self.network.state_dict().items()})
