"""BEMA: bias-corrected exponential moving average of the weights (reference/trl.md section 3)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_trainer.callbacks._bema_math import bema_coefficients, bema_update_  # noqa: F401 (re-exported)
from lit_trainer.callbacks.hf_export import export_hf

_FORMAT = 1
_HPARAMS = ("update_freq", "ema_power", "bias_power", "lag", "update_after", "multiplier", "min_ema_multiplier")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


_RULES = {
    "update_freq": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "ema_power": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "bias_power": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "lag": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "update_after": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "multiplier": (lambda v: _is_real(v) and v > 0, "a finite number > 0 (so that lag + multiplier*t > 0)"),
    "min_ema_multiplier": (lambda v: _is_real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "ref_model_update_freq": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "ref_model_update_after": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    **{flag: (lambda v: isinstance(v, bool), "True or False")
       for flag in ("update_ref_model", "evaluate_with_bema", "apply_at_end", "export_hf")},
    "export_dir": (lambda v: v is None or (isinstance(v, (str, os.PathLike)) and str(v) != ""), "None or a path"),
}


def _check_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"`BEMA(device={device!r})` is invalid: use a torch device such as 'cpu' or 'cuda', "
                         "or None to keep each buffer next to its parameter.") from err


def ref_model_name(name: str, ref_names: set[str]) -> str | None:
    """Name in ``pl_module.ref_model`` of the tracked parameter ``name`` (relative to the LightningModule).

    ``model.<rest>`` maps to ``<rest>`` when the reference model has it (``ref_model`` mirrors ``pl_module.model``,
    the DPO layout); otherwise a name maps to itself (``ref_model`` mirrors the LightningModule).

    Args:
        name: e.g. ``"model.model.layers.0.mlp.up_proj.weight"``.
        ref_names: every parameter name of the reference model (aliases of tied weights included).

    Returns:
        The reference model's name (``"model.layers.0.mlp.up_proj.weight"``), or ``None`` when nothing matches.
    """
    if name.startswith("model.") and name[len("model."):] in ref_names:
        return name[len("model."):]
    return name if name in ref_names else None


class BEMA(Callback):
    r"""Bias-corrected EMA of the trainable weights (Block et al. 2025), with TRL 1.16's numbers.

    After optimizer step ``t`` (``trainer.global_step``, 1-based, absolute): for ``t < update_after`` nothing; at
    ``t == update_after`` the snapshot ``theta0 = ema = theta_t`` (no output update); afterwards, on every
    ``(t - update_after) % update_freq == 0`` step, with ``beta, alpha`` from :func:`bema_coefficients`,
    ``ema <- (1-beta) ema + beta theta_t`` and ``bema <- ema + alpha (theta_t - theta0)``. The EMA only advances on
    update steps. All three buffers start as the weights at train start (so ``update_after=0`` snapshots there and
    the output before the first update is the initial weights, as in TRL).

    Beyond TRL: parameters are tracked by name and frozen ones are skipped; the state is in the checkpoint
    (``checkpoint["callbacks"]["BEMA"]``: ``theta0``/``ema``/``bema`` as ``{name: tensor}`` plus step counters,
    loadable with ``weights_only=True``) so a resumed run continues the same average; the checkpoint's
    ``state_dict`` always holds the live weights (also when saved mid-validation with the BEMA weights swapped in).

    Distributed: every DDP rank keeps the same three buffers (3x the trainable parameters, on ``device``). After the
    gradient all-reduce all ranks hold identical weights, so they compute identical averages with no communication,
    and ``evaluate_with_bema`` / ``update_ref_model`` need the weights on every rank. Lightning saves rank 0's
    state; on resume every rank loads that same state. FSDP, ModelParallel and DeepSpeed ZeRO-3 (sharded
    parameters) are refused at setup. If one batch makes several optimizer steps (manual optimization), the
    schedule is still followed but uses the weights after the batch.

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
            :func:`ref_model_name`) after step ``t`` when ``t >= ref_model_update_after`` and
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
        self, update_freq: int = 400, ema_power: float = 0.5, bias_power: float = 0.2, lag: float = 10,
        update_after: int = 0, multiplier: float = 1.0, min_ema_multiplier: float = 0.0,
        device: str | torch.device | None = "cpu", update_ref_model: bool = False, ref_model_update_freq: int = 400,
        ref_model_update_after: int = 0, evaluate_with_bema: bool = False, apply_at_end: bool = False,
        export_dir: str | os.PathLike | None = None, export_hf: bool = True,
    ) -> None:
        args = dict(locals())
        for name, (ok, need) in _RULES.items():
            if not ok(args[name]):
                raise ValueError(f"`BEMA({name}={args[name]!r})` is invalid: {name} must be {need}.")
        self.update_freq, self.ema_power, self.bias_power, self.lag = update_freq, ema_power, bias_power, lag
        self.update_after, self.multiplier, self.min_ema_multiplier = update_after, multiplier, min_ema_multiplier
        self.device = _check_device(device)
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

    def bema_state_dict(self) -> dict[str, torch.Tensor]:
        """The current BEMA weights.

        Returns:
            ``{name: tensor}`` with names as in ``pl_module.named_parameters()``; the buffers themselves (clone them
            to keep a copy while training goes on).

        Raises:
            RuntimeError: before ``trainer.fit`` has started (no weights yet).
        """
        if not self._names and self._loaded is not None:
            return dict(self._loaded["bema"])
        if not self._names:
            raise RuntimeError("BEMA has no weights yet: call `bema_state_dict()` after `trainer.fit` has started.")
        return dict(zip(self._names, self._bema))

    @classmethod
    def bema_weights_from_checkpoint(cls, path: str | os.PathLike) -> dict[str, torch.Tensor]:
        """The BEMA weights stored in a Lightning checkpoint (whose ``state_dict`` holds the live weights).

        Args:
            path: a ``.ckpt`` written while this callback was active.

        Returns:
            ``{name: tensor}`` as :meth:`bema_state_dict`, on CPU.

        Raises:
            ValueError: the checkpoint was written before training started.
        """
        state = torch.load(path, map_location="cpu", weights_only=True)["callbacks"][cls.__qualname__]
        if not state.get("initialized"):
            raise ValueError(f"The checkpoint {str(path)!r} holds no BEMA weights (saved before training started).")
        return state["bema"]

    def _hparams(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in _HPARAMS}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)) or getattr(strategy, "zero_stage_3", False):
            raise ValueError(f"BEMA does not support sharded parameters ({type(strategy).__name__}): use "
                             "strategy='ddp' (or DeepSpeed stage 1/2), or remove the BEMA callback.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.update_ref_model:  # after configure_model, so a lazily built ref_model exists; fail before training
            self._resolve_ref_params(pl_module, self._trainable(pl_module))

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
            rank_zero_warn(f"BEMA: {step - self._step} optimizer steps in one batch; the schedule uses the weights "
                           "after the batch.", category=UserWarning)
        for t in range(self._step + 1, step + 1):
            self._on_optimizer_step(t)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.evaluate_with_bema and trainer.state.fn == TrainerFn.FITTING:
            self._attach(trainer, pl_module)
            self._swap_in()

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
                torch._foreach_copy_(self._params, self._bema)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
                           ) -> None:
        if self._stash is None or "state_dict" not in checkpoint:
            return
        weights = checkpoint["state_dict"]  # saved mid-validation: put the live weights, not the BEMA ones
        for key, idx in self._alias.items():
            if key in weights:
                weights[key] = self._stash[idx]

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self._names:
            return self._loaded if self._loaded is not None else {"format": _FORMAT, "initialized": False}
        return {
            "format": _FORMAT, "initialized": True, "step": self._step, "num_updates": self._num_updates,
            "hparams": self._hparams(), "theta0": dict(zip(self._names, self._theta0)),
            "ema": dict(zip(self._names, self._ema)), "bema": dict(zip(self._names, self._bema)),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != _FORMAT:
            raise ValueError(f"BEMA checkpoint state has format {state_dict.get('format')!r}, expected {_FORMAT}.")
        self._swap_out()
        self._names, self._module_id = [], None  # re-attach from the loaded state in on_train_start
        self._loaded = state_dict if state_dict.get("initialized") else None
        if self._loaded is not None and self._loaded["hparams"] != self._hparams():
            rank_zero_warn(f"BEMA resumes a state made with {self._loaded['hparams']} under {self._hparams()}; "
                           "the average continues with the new settings.", category=UserWarning)

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
        self._ref_params = self._resolve_ref_params(pl_module, tracked) if self.update_ref_model else []
        if self._loaded is not None:
            self._restore(self._loaded)
        else:
            self._theta0, self._ema, self._bema = (self._snapshot() for _ in range(3))
            self._step, self._num_updates = trainer.global_step, 0
        self._module_id, self._loaded = id(pl_module), None
        rank_zero_info(f"BEMA tracks {len(self._names)} parameter tensors "
                       f"({sum(p.numel() for p in self._params):,} values) on {self.device or 'their own devices'}.")

    def _buffer_device(self, param: torch.Tensor) -> torch.device:
        return self.device if self.device is not None else param.device

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().to(self._buffer_device(p), copy=True) for p in self._params]

    def _restore(self, state: dict[str, Any]) -> None:
        saved = list(state["bema"])
        if sorted(saved) != sorted(self._names):
            missing, extra = sorted(set(self._names) - set(saved)), sorted(set(saved) - set(self._names))
            raise ValueError(f"The BEMA checkpoint state does not match the module's trainable parameters "
                             f"(missing from the checkpoint: {missing[:5]}, unknown: {extra[:5]}). Resume with the "
                             "same trainable parameters, or drop `checkpoint['callbacks']['BEMA']`.")
        for name, p in zip(self._names, self._params):
            if state["bema"][name].shape != p.shape:
                raise ValueError(f"BEMA checkpoint shape {tuple(state['bema'][name].shape)} for {name!r} does not "
                                 f"match the parameter's {tuple(p.shape)}.")
        self._theta0, self._ema, self._bema = (
            [state[key][n].to(self._buffer_device(p), p.dtype, copy=True) for n, p in zip(self._names, self._params)]
            for key in ("theta0", "ema", "bema")
        )
        self._step, self._num_updates = int(state["step"]), int(state["num_updates"])

    def _resolve_ref_params(self, pl_module: pl.LightningModule, tracked: dict[str, torch.nn.Parameter]
                            ) -> list[torch.Tensor]:
        ref = getattr(pl_module, "ref_model", None)
        if not isinstance(ref, torch.nn.Module):
            raise ValueError(f"`BEMA(update_ref_model=True)` needs `pl_module.ref_model` (a torch.nn.Module), but "
                             f"{type(pl_module).__name__}.ref_model is {type(ref).__name__}{getattr(ref, 'why', '')}"
                             ". Give the module a frozen reference model, or set update_ref_model=False.")
        ref_named = dict(ref.named_parameters(remove_duplicate=False))
        live_ptrs = {p.data_ptr() for p in tracked.values()}
        shared = [n for n, p in ref_named.items() if p.data_ptr() in live_ptrs]
        if shared:
            raise ValueError(f"`pl_module.ref_model` has parameters that are being trained ({shared[:3]}): it is "
                             "the policy itself or not frozen, and BEMA would overwrite the policy. Give it its own "
                             "frozen copy, e.g. `copy.deepcopy(model).requires_grad_(False)`.")
        ref_names = set(ref_named)
        mapped = {n: ref_model_name(n, ref_names) for n in tracked}
        missing = [n for n, r in mapped.items() if r is None or ref_named[r].shape != tracked[n].shape]
        if missing:
            raise ValueError(f"`pl_module.ref_model` has no parameter matching {missing[:5]} (name and shape). "
                             "Tracked names map `model.<rest>` -> `<rest>`, other names to themselves.")
        return [ref_named[mapped[n]] for n in tracked]

    def _on_optimizer_step(self, step: int) -> None:
        """TRL's on_step_end for the 1-based absolute step ``step``."""
        tau = self.update_after
        if step == tau:
            with torch.no_grad():
                torch._foreach_copy_(self._theta0, self._params)
                torch._foreach_copy_(self._ema, self._theta0)
        elif step > tau and (step - tau) % self.update_freq == 0:
            beta, alpha = bema_coefficients(step, lag=self.lag, multiplier=self.multiplier, ema_power=self.ema_power,
                                            bias_power=self.bias_power, min_ema_multiplier=self.min_ema_multiplier)
            bema_update_(self._ema, self._bema, self._theta0, self._params, beta, alpha)
            self._num_updates += 1
        tau_ref = self.ref_model_update_after
        if self.update_ref_model and step >= tau_ref and (step - tau_ref) % self.ref_model_update_freq == 0:
            with torch.no_grad():
                torch._foreach_copy_(self._ref_params, self._bema)
        self._step = step

    def _swap_in(self) -> None:
        if self._stash is not None:
            return
        with torch.no_grad():
            stash = [torch.empty_like(b) for b in self._bema]
            torch._foreach_copy_(stash, self._params)
            self._stash = stash
            torch._foreach_copy_(self._params, self._bema)

    def _swap_out(self) -> None:
        if self._stash is None:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._params, self._stash)
        self._stash = None

    def _export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``save_pretrained`` the BEMA weights (rank 0; written under a partial name, then renamed into place)."""
        model = getattr(pl_module, "model", None)
        if not self.export_hf or not hasattr(model, "save_pretrained"):
            return
        root = trainer.log_dir or trainer.default_root_dir
        target = Path(self.export_dir) if self.export_dir is not None else Path(root) / "bema"
        if trainer.is_global_zero:
            weights = model.state_dict()  # frozen parameters and buffers as they are; tied keys share one tensor
            for key in weights:
                if "model." + key in self._alias:
                    weights[key] = self._bema[self._alias["model." + key]]
            export_hf(model, getattr(pl_module, "tokenizer", None), target, state_dict=weights)
            rank_zero_info(f"BEMA weights saved to {target}")
        trainer.strategy.barrier("bema_export")
