"""BEMA: bias-corrected exponential moving average of the weights (see docs/design.md#trl-bema).

The callback is here; its private parts beside it: the maths (``_math``), the argument checks (``_options``), the
sharded buffers (``_shards``), the checkpoint state (``_state``), the reference-model refresh (``_reference``) and the
Hugging Face export (``_export``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lit_trainer.callbacks.bema._export import export_bema_weights
from lit_trainer.callbacks.bema._math import bema_coefficients, bema_update_
from lit_trainer.callbacks.bema._options import HPARAMS, check_bema_args, check_device
from lit_trainer.callbacks.bema._reference import resolve_ref_params
from lit_trainer.callbacks.bema._shards import as_param_layout, gather, locals_of
from lit_trainer.callbacks.bema._state import (
    bema_state_from_checkpoint,
    bema_state_keys,
    check_format,
    empty_state,
    pack_state,
    unpack_buffers,
)
from lit_trainer.core.lightning_namespace import PackageBound
from lit_trainer.core.sharding import is_dtensor, local


class _BEMA(PackageBound):
    r"""Bias-corrected EMA of the trainable weights (Block et al. 2025), with TRL 1.16's numbers.

    After optimizer step ``t`` (``trainer.global_step``, 1-based, absolute): for ``t < update_after`` nothing; at
    ``t == update_after`` the snapshot ``theta0 = ema = theta_t`` (no output update); afterwards, on every
    ``(t - update_after) % update_freq == 0`` step, with ``beta, alpha`` from :func:`bema_coefficients`,
    ``ema <- (1-beta) ema + beta theta_t`` and ``bema <- ema + alpha (theta_t - theta0)``. The EMA only advances on
    update steps. All three buffers start as the weights at train start (so ``update_after=0`` snapshots there and
    the output before the first update is the initial weights, as in TRL).

    Beyond TRL: parameters are tracked by name and frozen ones are skipped; the state is in the checkpoint
    (``checkpoint["callbacks"][bema.state_key]``: ``theta0``/``ema``/``bema`` as ``{name: tensor}`` plus step
    counters, loadable with ``weights_only=True``) so a resumed run continues the same average. The key holds the
    settings (``"BEMA{'update_freq': 400, ...}"``, as Lightning's ``EarlyStopping``), so several BEMA callbacks
    coexist; a checkpoint keyed ``"BEMA"`` (older versions) still loads, and a lone BEMA whose settings changed
    adopts the lone saved state with a warning. The checkpoint's ``state_dict`` always holds the live weights (also
    when saved mid-validation with the BEMA weights swapped in); ``BestCheckpoint`` adds the scored BEMA weights
    beside them (see :attr:`evaluates_other_weights`).

    Distributed: every DDP rank keeps the same three buffers (3x the trainable parameters, on ``device``). After the
    gradient all-reduce all ranks hold identical weights, so they compute identical averages with no communication,
    and ``evaluate_with_bema`` / ``update_ref_model`` need the weights on every rank. Lightning saves rank 0's
    state; on resume every rank loads that same state. Under ``ModelParallelStrategy`` (FSDP2) each rank keeps the
    buffers of its own parameter shards (the update is elementwise); ``bema_state_dict()``, the checkpoint state,
    the scored weights and the export hold full tensors, gathered by every rank (``bema._shards``); a reference
    for ``update_ref_model`` must be sharded alike. FSDP1 and DeepSpeed ZeRO-3 are refused at setup. If one batch
    makes several optimizer steps (manual optimization), the schedule is still followed, with the final weights.

    Args:
        update_freq: update the EMA and output every this many optimizer steps (phi).
        ema_power: kappa in ``beta_t = (lag + multiplier t)^-kappa``; 0 gives ``ema = theta_t``.
        bias_power: eta in ``alpha_t = (lag + multiplier t)^-eta``; 0 is full correction, large is a plain EMA.
        lag: rho, offset of the step in both coefficients.
        update_after: tau, the step of the snapshot ``theta0``; updates follow every ``update_freq`` steps.
        multiplier: gamma, scale of the step in both coefficients.
        min_ema_multiplier: lower bound for ``beta_t``.
        device: where the buffers live (``None``: next to each parameter).
        update_ref_model: copy the BEMA weights into ``pl_module.ref_model`` (names mapped by
            :func:`~lit_trainer.callbacks.bema._reference.ref_model_name`) after step ``t`` when
            ``t >= ref_model_update_after`` and
            ``(t - ref_model_update_after) % ref_model_update_freq == 0``.
        ref_model_update_freq: period, ref_model_update_after: first step of the reference-model refresh.
        evaluate_with_bema: run validation during fit with the BEMA weights (swapped in on validation start and
            out on validation end, on an exception and at teardown).
        apply_at_end: copy the BEMA weights into the module at train end.
        export_dir: where to ``save_pretrained`` the BEMA weights at train end (rank 0, atomic) when
            ``pl_module.model`` is a Hugging Face model; default ``<trainer.log_dir or default_root_dir>/bema``.
        export_hf: set False to skip that export.

    Raises:
        ValueError: an argument is out of range (the message names it and the valid range); at fit start, a
            sharded strategy, or ``update_ref_model`` without a usable ``pl_module.ref_model``.

    Example::

        trainer = Trainer(callbacks=[BEMA(update_freq=100, evaluate_with_bema=True)])
        trainer.fit(module)
        weights = trainer.callbacks[0].bema_state_dict()  # {"model.lm_head.weight": tensor, ...}
    """

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: float = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str | torch.device | None = "cpu",
        update_ref_model: bool = False,
        ref_model_update_freq: int = 400,
        ref_model_update_after: int = 0,
        evaluate_with_bema: bool = False,
        apply_at_end: bool = False,
        export_dir: str | os.PathLike | None = None,
        export_hf: bool = True,
    ) -> None:
        check_bema_args(dict(locals()))
        self.update_freq, self.ema_power, self.bias_power, self.lag = update_freq, ema_power, bias_power, lag
        self.update_after, self.multiplier, self.min_ema_multiplier = update_after, multiplier, min_ema_multiplier
        self.device = check_device(device)
        self.update_ref_model, self.ref_model_update_freq = update_ref_model, ref_model_update_freq
        self.ref_model_update_after, self.evaluate_with_bema = ref_model_update_after, evaluate_with_bema
        self.apply_at_end, self.export_dir, self.export_hf = apply_at_end, export_dir, export_hf
        self._names: list[str] = []  # tracked (trainable) parameter names, aligned with the lists below
        self._params: list[torch.nn.Parameter] = []
        self._theta0: list[torch.Tensor] = []
        self._ema: list[torch.Tensor] = []
        self._bema: list[torch.Tensor] = []
        self._ref_params: list[torch.Tensor] = []  # pl_module.ref_model's counterparts (update_ref_model)
        self._alias: dict[str, int] = {}  # every state_dict key of a tracked parameter (tied aliases too) -> index
        self._step, self._num_updates = 0, 0  # last optimizer step seen; number of EMA updates
        self._module_id: int | None = None
        self._loaded: dict[str, Any] | None = None  # checkpoint state waiting for the module (load_state_dict)
        self._stash: list[torch.Tensor] | None = None  # the live weights while the BEMA weights are swapped in
        self._scored_step: int | None = None  # the step whose BEMA weights the latest validation scored

    def bema_state_dict(self) -> dict[str, torch.Tensor]:
        """The current BEMA weights.

        Returns:
            ``{name: tensor}`` with names as in ``pl_module.named_parameters()``; the buffers themselves (clone them
            to keep a copy while training goes on). Sharded: full tensors gathered from every rank's shard (a
            collective: call it on every rank).

        Raises:
            RuntimeError: before ``trainer.fit`` has started (no weights yet).
        """
        if not self._names and self._loaded is not None:
            return dict(self._loaded["bema"])
        if not self._names:
            raise RuntimeError("BEMA has no weights yet: call `bema_state_dict()` after `trainer.fit` has started.")
        return dict(zip(self._names, gather(self._bema, self._params)))

    @classmethod
    def bema_weights_from_checkpoint(
        cls, path: str | os.PathLike, state_key: str | None = None
    ) -> dict[str, torch.Tensor]:
        """The BEMA weights stored in a Lightning checkpoint (whose ``state_dict`` holds the live weights).

        Args:
            path: a ``.ckpt`` (or a distributed checkpoint folder) written while this callback was active.
            state_key: which BEMA callback's state (its :attr:`state_key`); needed only when the checkpoint holds
                several.

        Returns:
            ``{name: tensor}`` as :meth:`bema_state_dict`, on CPU.

        Raises:
            ValueError: no BEMA state, several and no ``state_key``, or a state written before training started.
        """
        return bema_state_from_checkpoint(path, state_key, cls.__qualname__)["bema"]

    @property
    @override
    def state_key(self) -> str:
        """``BEMA{...settings...}``: the checkpoint key; two BEMA callbacks with other settings do not collide."""
        return self._generate_state_key(**self._hparams())

    @property
    def evaluates_other_weights(self) -> bool:
        """Whether validation during fit scores the BEMA weights instead of the live ones (``evaluate_with_bema``).

        With :meth:`evaluated_weights`, the protocol through which a checkpoint callback (``BestCheckpoint``) keeps
        the weights that were scored next to the live ones.
        """
        return self.evaluate_with_bema

    def evaluated_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights the latest validation during fit scored, keyed like ``pl_module.state_dict()`` (tied aliases
        included; full tensors, gathered by every rank when sharded); ``None`` when that validation scored the live
        weights or the BEMA weights changed since."""
        if not self.evaluate_with_bema or self._scored_step is None or self._scored_step != self._step:
            return None
        weights = gather(self._bema, self._params)
        return {key: weights[idx] for key, idx in self._alias.items()}

    def _hparams(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in HPARAMS}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # checks the trainer's Lightning package
        strategy = trainer.strategy
        if isinstance(strategy, self._ns.FSDPStrategy) or getattr(strategy, "zero_stage_3", False):
            raise ValueError(
                f"BEMA does not support {type(strategy).__name__}'s sharded parameters: use "
                "ModelParallelStrategy (FSDP2), strategy='ddp' (or DeepSpeed stage 1/2), or remove the "
                "BEMA callback."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.update_ref_model:  # after configure_model, so a lazily built ref_model exists; fail before training
            resolve_ref_params(pl_module, self._trainable(pl_module))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step <= self._step:  # no optimizer step in this micro-batch (gradient accumulation)
            return
        if step > self._step + 1:
            self._ns.rank_zero_warn(
                f"BEMA: {step - self._step} optimizer steps in one batch; the schedule uses the "
                "weights after the batch.",
                category=UserWarning,
            )
        for t in range(self._step + 1, step + 1):
            self._on_optimizer_step(t)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.evaluate_with_bema and trainer.state.fn == TrainerFn.FITTING:
            self._attach(trainer, pl_module)
            self._swap_in()
            self._scored_step = self._step

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._swap_out()  # runs before any Checkpoint callback's on_exception (Lightning orders those last)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._swap_out()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._names:
            return
        self._swap_out()
        self._export(trainer, pl_module)
        if self.apply_at_end:
            with torch.no_grad():
                torch._foreach_copy_(locals_of(self._params), self._bema)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._stash is None or "state_dict" not in checkpoint:
            return
        weights = checkpoint["state_dict"]  # saved mid-validation: put the live weights, not the BEMA ones
        full = gather(self._stash, self._params)  # sharded: a collective every rank joins, whatever it saves
        for key, idx in self._alias.items():
            if key in weights:  # a sharded (DTensor) state_dict keeps the live shards, a full one the full weights
                shard = is_dtensor(weights[key])
                weights[key] = as_param_layout(self._stash[idx], self._params[idx]) if shard else full[idx]

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self._names:
            return self._loaded if self._loaded is not None else empty_state()
        buffers = (self._theta0, self._ema, self._bema)
        return pack_state(self._names, self._params, buffers, self._step, self._num_updates, self._hparams())

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Adopt the checkpoint's only BEMA state when this (only) BEMA callback's settings changed since."""
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states or self._legacy_state_key in states:
            return  # Lightning passes it to load_state_dict
        saved = bema_state_keys(states, type(self).__qualname__)
        mine = [cb for cb in trainer.callbacks if type(cb).__qualname__ == type(self).__qualname__]
        if len(saved) == 1 and len(mine) == 1:
            self.load_state_dict(states[saved[0]])  # warns that the settings changed
        elif saved:
            self._ns.rank_zero_warn(
                f"BEMA {self.state_key} finds no state of its own among {saved}: its average "
                "restarts from the resumed weights.",
                category=UserWarning,
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_format(state_dict)
        self._swap_out()
        self._names, self._module_id, self._scored_step = [], None, None  # re-attach in on_train_start
        self._loaded = state_dict if state_dict.get("initialized") else None
        if self._loaded is not None and self._loaded["hparams"] != self._hparams():
            self._ns.rank_zero_warn(
                f"BEMA resumes a state made with {self._loaded['hparams']} under "
                f"{self._hparams()}; the average continues with the new settings.",
                category=UserWarning,
            )

    @staticmethod
    def _trainable(pl_module: pl.LightningModule) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in pl_module.named_parameters() if p.requires_grad}

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Bind the buffers to the module's trainable parameters: from the loaded checkpoint state or a snapshot."""
        if self._names and self._module_id == id(pl_module):
            return
        tracked = self._trainable(pl_module)
        if not tracked:
            raise ValueError("BEMA found no trainable parameter in the LightningModule (all have requires_grad=False).")
        self._names, self._params = list(tracked), list(tracked.values())
        index = {id(p): i for i, p in enumerate(self._params)}
        self._alias = {n: index[id(p)] for n, p in pl_module.named_parameters(remove_duplicate=False) if id(p) in index}
        self._ref_params = resolve_ref_params(pl_module, tracked) if self.update_ref_model else []
        if self._loaded is not None:
            self._restore(self._loaded)
        else:
            self._theta0, self._ema, self._bema = (self._snapshot() for _ in range(3))
            self._step, self._num_updates = trainer.global_step, 0
        self._module_id, self._loaded = id(pl_module), None
        self._ns.rank_zero_info(
            f"BEMA tracks {len(self._names)} parameter tensors "
            f"({sum(p.numel() for p in self._params):,} values) on {self.device or 'their own devices'}."
        )

    def _buffer_device(self, param: torch.Tensor) -> torch.device:
        return self.device if self.device is not None else param.device

    def _snapshot(self) -> list[torch.Tensor]:  # of this rank's shards when sharded
        return [local(p).detach().to(self._buffer_device(p), copy=True) for p in self._params]

    def _restore(self, state: dict[str, Any]) -> None:
        self._theta0, self._ema, self._bema = unpack_buffers(state, self._names, self._params, self._buffer_device)
        self._step, self._num_updates = int(state["step"]), int(state["num_updates"])

    def _on_optimizer_step(self, step: int) -> None:
        """TRL's on_step_end for the 1-based absolute step ``step``."""
        tau = self.update_after
        if step == tau:
            with torch.no_grad():
                torch._foreach_copy_(self._theta0, locals_of(self._params))
                torch._foreach_copy_(self._ema, self._theta0)
        elif step > tau and (step - tau) % self.update_freq == 0:
            beta, alpha = bema_coefficients(
                step,
                lag=self.lag,
                multiplier=self.multiplier,
                ema_power=self.ema_power,
                bias_power=self.bias_power,
                min_ema_multiplier=self.min_ema_multiplier,
            )
            bema_update_(self._ema, self._bema, self._theta0, locals_of(self._params), beta, alpha)
            self._num_updates += 1
        tau_ref = self.ref_model_update_after
        if self.update_ref_model and step >= tau_ref and (step - tau_ref) % self.ref_model_update_freq == 0:
            with torch.no_grad():
                torch._foreach_copy_(locals_of(self._ref_params), self._bema)
        self._step = step

    def _swap_in(self) -> None:
        if self._stash is not None:
            return
        with torch.no_grad():
            stash = [torch.empty_like(b) for b in self._bema]
            torch._foreach_copy_(stash, locals_of(self._params))
            self._stash = stash
            torch._foreach_copy_(locals_of(self._params), self._bema)

    def _swap_out(self) -> None:
        if self._stash is None:
            return
        with torch.no_grad():
            torch._foreach_copy_(locals_of(self._params), self._stash)
        self._stash = None

    def _export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``save_pretrained`` the BEMA weights (rank 0; written under a partial name, then renamed into place)."""
        if not self.export_hf or not hasattr(getattr(pl_module, "model", None), "save_pretrained"):
            return
        root = trainer.log_dir or trainer.default_root_dir
        target = Path(self.export_dir) if self.export_dir is not None else Path(root) / "bema"
        export_bema_weights(trainer, pl_module, target, self._bema, self._params, self._alias)
        self._ns.rank_zero_info(f"BEMA weights saved to {target}")


class BEMA(_BEMA, Callback):
    __doc__ = _BEMA.__doc__
