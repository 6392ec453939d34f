"""Parameter-efficient fine-tuning with the ``peft`` library (optional extra: ``pip install "lit_trainer[peft]"``).

We write no adapter layers: ``peft.get_peft_model`` wraps the Hugging Face model at module construction, the
optimizer receives only the parameters that require gradients (the adapters), and the reference model that DPO and
GRPO need is the same network with its adapters switched off (:class:`AdapterReference`), so no second copy of the
weights is held.

``peft_config`` is a ``peft.PeftConfig`` (e.g. ``LoraConfig``) or a mapping (YAML): a mapping with a ``peft_type`` key
goes through ``peft.get_peft_config`` (any peft method), any other mapping is ``peft.LoraConfig(**mapping)``. A config
without ``task_type`` gets the module's (``"CAUSAL_LM"``, ``"SEQ_CLS"`` for the reward module); a config or saved
adapter of another task type is refused (peft would wrap the model for that task and export an adapter marked so).

``adapter_path`` starts from a saved adapter instead (it carries its own config, so it excludes ``peft_config``): it is
loaded as the trainable adapter ``"default"``; modules that need a reference load it a second time as the frozen
adapter ``"reference"`` and score the reference with that adapter active, so the reference is the adapter's starting
point (TRL's ``ref_adapter_name``). Without ``adapter_path`` the reference is the base model (adapters disabled),
which is also the policy's starting point since LoRA starts with a zero update.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

TRAINABLE_ADAPTER = "default"
REFERENCE_ADAPTER = "reference"
_INSTALL = 'peft is not installed: `pip install "lit_trainer[peft]"` (or `pip install peft`).'


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:  # pragma: no cover - the test extra installs peft
        raise ImportError(f"`peft_config`/`adapter_path` need the peft library. {_INSTALL}") from err
    return peft


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing peft when nothing imported it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


#: the peft ``task_type`` of each module task (:data:`lit_trainer.models.Task`)
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}
_WHY = {
    "CAUSAL_LM": "this module trains a causal language model (task_type CAUSAL_LM), and peft would wrap it for "
    "another task and export an adapter marked {found}",
    "SEQ_CLS": "a reward model is a sequence classifier and needs task_type 'SEQ_CLS' (peft then trains and saves the "
    "new score head with the adapters; with another task type the score head stays frozen at its random start)",
}


def check_task_type(found: Any, expected: str, source: str) -> None:
    """Refuse a peft ``task_type`` other than the module's.

    Args:
        found: the config's task type (a string or peft's ``TaskType``).
        expected: the module's (a value of :data:`TASK_TYPES`).
        source: what carries it, e.g. ``"peft_config"`` or ``"adapter_path='runs/x'"``.

    Raises:
        ValueError: naming the value and the fix.
    """
    if found is None:  # a config saved without a task type (plain peft code often leaves it out): nothing to refuse
        return
    found = str(getattr(found, "value", found))
    if found == expected:
        return
    fix = f"Set task_type: {expected}, or leave it out." if source == "peft_config" else (
        f"Give an adapter trained with task_type {expected}."
    )  # fmt: skip
    raise ValueError(f"`{source}` has task_type={found!r}: {_WHY[expected].format(found=found)}. {fix}")


def as_peft_config(spec: Any, task_type: str = "CAUSAL_LM") -> Any:
    """A ``peft.PeftConfig`` from a config object or a mapping (module docstring); ``task_type`` defaults to the
    module's ``task_type``.

    Raises:
        ValueError: a mapping with keys the config class does not know (the message names them), or a config of
            another task type.
        TypeError: anything else than a mapping or a ``peft.PeftConfig``.
    """
    peft = _peft()
    if isinstance(spec, Mapping):
        mapping = dict(spec)
        mapping["task_type"] = mapping.get("task_type") or task_type
        check_task_type(mapping["task_type"], task_type, "peft_config")
        try:
            return peft.get_peft_config(mapping) if "peft_type" in mapping else peft.LoraConfig(**mapping)
        except TypeError as err:
            raise ValueError(
                f"`peft_config={dict(spec)!r}` is invalid ({err}): give the keyword arguments of "
                "peft.LoraConfig (r, lora_alpha, target_modules, ...), or a `peft_type` key for "
                "another peft method."
            ) from None
    if not isinstance(spec, peft.PeftConfig):
        raise TypeError(
            f"`peft_config` must be a peft.PeftConfig (e.g. LoraConfig) or a mapping of its arguments, "
            f"not {type(spec).__name__}."
        )
    config = copy.deepcopy(spec)  # peft fills fields of the config it is given: keep the caller's intact
    if config.task_type is None:
        config.task_type = task_type
    check_task_type(config.task_type, task_type, "peft_config")
    return config


def config_hparam(spec: Any, task_type: str = "CAUSAL_LM") -> dict[str, Any] | None:
    """A plain (JSON) mapping of ``peft_config`` for ``hparams``: checkpoints stay loadable with ``weights_only``."""
    if spec is None or isinstance(spec, Mapping):
        return None if spec is None else dict(spec)
    as_list = lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)
    plain = json.dumps(as_peft_config(spec, task_type).to_dict(), default=as_list)
    return json.loads(plain)


def wrap_model(
    model: Any, peft_config: Any, adapter_path: str | None, with_reference: bool, task_type: str = "CAUSAL_LM"
) -> Any:
    """Wrap ``model`` with a new adapter (``peft_config``) or a saved one (``adapter_path``).

    Args:
        model: a transformers model.
        peft_config: see :func:`as_peft_config`; None with ``adapter_path``.
        adapter_path: directory written by ``PeftModel.save_pretrained`` (or ``HFExport`` of a peft run).
        with_reference: load ``adapter_path`` a second time as the frozen ``"reference"`` adapter.
        task_type: the module's peft task type (:data:`TASK_TYPES`); a config or adapter of another is refused.

    Raises:
        ValueError: both ``peft_config`` and ``adapter_path`` given, or another task type.
    """
    peft = _peft()
    if peft_config is not None and adapter_path is not None:
        raise ValueError(
            "`peft_config` and `adapter_path` are exclusive: a saved adapter carries its own config. "
            "Give `adapter_path` alone to continue training it, or `peft_config` alone for a new one."
        )
    if adapter_path is None:
        return peft.get_peft_model(model, as_peft_config(peft_config, task_type), adapter_name=TRAINABLE_ADAPTER)
    saved = peft.PeftConfig.from_pretrained(adapter_path)
    check_task_type(saved.task_type, task_type, f"adapter_path={adapter_path!r}")
    wrapped = peft.PeftModel.from_pretrained(model, adapter_path, adapter_name=TRAINABLE_ADAPTER, is_trainable=True)
    if with_reference:
        wrapped.load_adapter(adapter_path, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        wrapped.set_adapter(TRAINABLE_ADAPTER)
    return wrapped


def enable_gradient_checkpointing(model: Any) -> None:
    """Hugging Face activation (gradient) checkpointing with non-reentrant ``torch.utils.checkpoint``.

    Raises:
        ValueError: the model does not support it (the message names the class).
    """
    kwargs = {"use_reentrant": False}
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"`gradient_checkpointing=True`: {type(model).__name__} does not support gradient "
            "checkpointing (transformers' `supports_gradient_checkpointing` is False); set it to False."
        )
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 (the old name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # pragma: no cover - older transformers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` numbers of parameter values of ``model`` (tied weights counted once)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def log_parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """Log (rank 0) and return :func:`parameter_counts` of the policy."""
    trainable, total = parameter_counts(model)
    rank_zero_info(
        f"[lit_trainer] trainable parameters: {trainable:,} of {total:,} ({100.0 * trainable / max(1, total):.2f}%)"
    )
    return trainable, total


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every submodule in eval mode inside the block; each one's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


@contextmanager
def _reference_adapter(model: Any) -> Iterator[None]:
    """The frozen ``"reference"`` adapter active inside the block; ``requires_grad`` flags restored after (peft's
    ``set_adapter`` makes the active adapter trainable)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(REFERENCE_ADAPTER)
    try:
        yield
    finally:
        model.set_adapter(TRAINABLE_ADAPTER)
        for param, flag in flags:
            param.requires_grad_(flag)


class AdapterReference:
    """The reference model of DPO/GRPO under peft: the policy network itself, in eval mode and under ``no_grad``,
    with its adapters disabled (the base model) or, when the run started from a saved adapter, with the frozen
    ``"reference"`` adapter (that adapter's starting point) active.

    It holds no weights of its own (it is deliberately not an ``nn.Module``: nothing is registered, saved twice or
    moved twice); it is called like the model. ``eval``/``train`` are no-ops (it always runs in eval mode).

    Args:
        policy: the ``peft.PeftModel`` being trained.
    """

    training = False
    #: why a separate reference cannot be written (appended to BEMA's error for ``update_ref_model=True``)
    why = (
        " (peft: the reference model is the policy network with its adapters disabled, with no weights of its own "
        "that BEMA could overwrite; writing the averaged adapter into the shared base would change the policy too)"
    )

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def active(self) -> Any:
        """Context in which ``self.policy`` computes the reference outputs."""
        if REFERENCE_ADAPTER in getattr(self.policy, "peft_config", {}):
            return _reference_adapter(self.policy)
        return self.policy.disable_adapter()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), _eval_mode(self.policy), self.active():
            return self.policy(*args, **kwargs)

    def eval(self) -> AdapterReference:
        return self

    def train(self, mode: bool = True) -> AdapterReference:
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights that define the reference (everything but the trainable adapter): keys the precomputed
        reference log-probs."""
        trainable = {n for n, p in self.policy.named_parameters(remove_duplicate=False) if p.requires_grad}
        return {k: v for k, v in self.policy.state_dict().items() if k not in trainable}


def reference_or_copy(model: Any, frozen_copy: Any) -> Any:
    """The default reference of ``model``: an :class:`AdapterReference` under peft, else ``frozen_copy(model)``."""
    return AdapterReference(model) if is_peft_model(model) else frozen_copy(model)


def check_strategy(strategy: Any) -> None:
    """Refuse strategies peft runs were not built for: the checkpoint filtering and the adapter-disabled reference
    are checked on one device, under DDP and under ``ModelParallelStrategy`` (FSDP2: the model is wrapped by peft
    first, then sharded; adapter-only distributed checkpoints).

    Raises:
        ValueError: for any other strategy (FSDP1, DeepSpeed), naming the fix.
    """
    name = type(strategy).__name__
    if name not in ("SingleDeviceStrategy", "DDPStrategy", "ModelParallelStrategy"):
        raise ValueError(
            f"`peft_config`/`adapter_path` run on one device, under DDP or under ModelParallelStrategy; {name} is "
            "not supported (adapter-only checkpoints and the adapter-disabled reference are untested there). "
            "Use strategy='ddp', or ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1) "
            "to shard the frozen base."
        )
