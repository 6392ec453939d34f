"""Quantized (4-bit and 8-bit) base models with ``bitsandbytes`` (optional extra: ``pip install "lit_trainer[qlora]"``).

QLoRA: the frozen base is stored in 4 bits (NF4 or FP4, optionally double-quantized: the per-block scales quantized
again) and dequantized block by block in each forward pass; LoRA adapters train on top in full precision. 8-bit
(LLM.int8) bases work the same way. We write no quantization code: transformers' ``BitsAndBytesConfig`` quantizes the
weights while ``from_pretrained`` loads them, and ``peft.prepare_model_for_kbit_training`` readies the model.

``quantization`` is what a recipe writes:

- a shorthand: ``"nf4"`` (NF4 with double quantization: the QLoRA paper's choice), ``"fp4"`` (FP4 with double
  quantization) or ``"int8"`` (LLM.int8); the 4-bit compute dtype is then the model's dtype;
- a mapping of ``transformers.BitsAndBytesConfig`` arguments, e.g. ``{load_in_4bit: true, bnb_4bit_quant_type: nf4,
  bnb_4bit_use_double_quant: true, bnb_4bit_compute_dtype: bfloat16}``;
- a ``BitsAndBytesConfig`` (from Python).

A preset (``"tiny"``) has no files to load from: it is built, written to a temporary folder and loaded back through the
same quantizing ``from_pretrained`` as a real checkpoint.

This module knows nothing of training; :mod:`lit_trainer.modules.base` refuses a quantized base without an adapter.
"""

from __future__ import annotations

import copy
import inspect
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, get_args

import torch

QuantizationName = Literal["nf4", "fp4", "int8"]
"""The shorthands of ``quantization`` (see the module docstring)."""
INSTALL = 'pip install "lit_trainer[qlora]"  (or: pip install "bitsandbytes>=0.50")'


def require_bitsandbytes(what: str) -> Any:
    """Import ``bitsandbytes`` or raise an ``ImportError`` that names ``what`` needs it and the install line."""
    try:
        import bitsandbytes
    except ImportError as err:
        raise ImportError(f"{what} needs the bitsandbytes library, which is not installed: {INSTALL}") from err
    return bitsandbytes


def _bnb_config_class() -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig


def as_bnb_config(spec: Any, dtype: torch.dtype | None = None) -> Any:
    """A ``transformers.BitsAndBytesConfig`` from ``quantization`` (a shorthand, a mapping or a config).

    Args:
        spec: see the module docstring.
        dtype: the model's dtype: the 4-bit compute dtype of a shorthand (float32 when None).

    Raises:
        ValueError: an unknown shorthand or argument, an unknown 4-bit type, or neither/both of 4 and 8 bits; each
            message names the value and the fix.
        TypeError: anything else than a string, a mapping or a ``BitsAndBytesConfig``.
    """
    config_class = _bnb_config_class()
    if isinstance(spec, config_class):
        config = copy.deepcopy(spec)
    elif isinstance(spec, str):
        if spec not in get_args(QuantizationName):
            raise ValueError(
                f"`quantization={spec!r}` is not a known quantization: choose one of {get_args(QuantizationName)}, or "
                "give the arguments of transformers.BitsAndBytesConfig as a mapping."
            )
        if spec == "int8":
            config = config_class(load_in_8bit=True)
        else:
            config = config_class(
                load_in_4bit=True,
                bnb_4bit_quant_type=spec,
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype or torch.float32,
            )
    elif isinstance(spec, Mapping):
        known = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"`quantization` has unknown keys {unknown}: give arguments of transformers.BitsAndBytesConfig "
                f"({', '.join(sorted(k for k in known if k.startswith(('load_in', 'bnb_4bit'))))}, ...), "
                f"or a shorthand {get_args(QuantizationName)}."
            )
        config = config_class(**dict(spec))
    else:
        raise TypeError(
            f"`quantization` must be one of {get_args(QuantizationName)}, a mapping of BitsAndBytesConfig arguments "
            f"or a BitsAndBytesConfig, not {type(spec).__name__}."
        )
    _check_config(config)
    return config


def _check_config(config: Any) -> None:
    if config.load_in_4bit == config.load_in_8bit:
        raise ValueError(
            "`quantization` must set exactly one of load_in_4bit and load_in_8bit (True); "
            f"it sets load_in_4bit={config.load_in_4bit}, load_in_8bit={config.load_in_8bit}."
        )
    if config.load_in_4bit and config.bnb_4bit_quant_type not in ("nf4", "fp4"):
        raise ValueError(
            f"`quantization` has bnb_4bit_quant_type={config.bnb_4bit_quant_type!r}: bitsandbytes knows 'nf4' "
            "(4-bit NormalFloat, the QLoRA default) and 'fp4'."
        )


def describe(model: Any) -> str:
    """One line naming how ``model`` is quantized (for logs)."""
    config = getattr(_transformers_model(model).config, "quantization_config", None)
    if config is None or not hasattr(config, "load_in_8bit"):
        return "quantized"
    if config.load_in_8bit:
        return "8-bit (LLM.int8)"
    double = " + double quantization" if config.bnb_4bit_use_double_quant else ""
    dtype = str(config.bnb_4bit_compute_dtype).removeprefix("torch.")
    return f"4-bit {config.bnb_4bit_quant_type.upper()}{double}, compute dtype {dtype}"


def is_quantized(model: Any) -> bool:
    """Whether ``model`` (a transformers model, or a peft model around one) holds bitsandbytes-quantized weights."""
    base = _transformers_model(model)
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def _transformers_model(model: Any) -> Any:
    get_base = getattr(model, "get_base_model", None)  # a peft model
    return get_base() if callable(get_base) else model


def hparam(spec: Any) -> Any:
    """``quantization`` as a plain value for ``hparams`` (checkpoints load with ``weights_only=True``)."""
    if spec is None or isinstance(spec, (str, Mapping)):
        return spec if not isinstance(spec, Mapping) else {k: _plain(v) for k, v in spec.items()}
    return {k: _plain(v) for k, v in spec.to_dict().items()}


def _plain(value: Any) -> Any:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def load_quantized(load: Any, source: Any, spec: Any, dtype: torch.dtype | None, **kwargs: Any) -> Any:
    """Load a model with its weights quantized while they load.

    Args:
        load: ``from_pretrained`` of the auto class to use.
        source: a directory or hub id, or a built ``PreTrainedModel`` (a preset): written to a temporary folder first.
        spec: ``quantization`` (see the module docstring).
        dtype: the dtype the unquantized weights load in (None: the checkpoint's).
        **kwargs: passed to ``load``.
    """
    require_bitsandbytes("`quantization`")
    if dtype is None:
        dtype = source.dtype if not isinstance(source, str) else _checkpoint_dtype(source, kwargs)
    config = as_bnb_config(spec, dtype)
    if isinstance(source, str):
        return keep_standard_layout(_own_memory(load(source, quantization_config=config, dtype=dtype, **kwargs)))
    with tempfile.TemporaryDirectory(prefix="lit_trainer_quantize_") as folder, _no_progress_bars():
        source.save_pretrained(folder, safe_serialization=True)
        model = load(folder, quantization_config=config, dtype=dtype, **kwargs)
    if getattr(source, "generation_config", None) is not None:  # a causal LM's (a classifier has none)
        model.generation_config = copy.deepcopy(source.generation_config)
    # not the temporary folder (gone after this): peft records the base's name in every adapter it saves
    model.name_or_path, model.config._name_or_path = source.name_or_path, source.config._name_or_path
    return keep_standard_layout(_own_memory(model))


def _own_memory(model: Any) -> Any:
    """Copy the weights that were not quantized (embeddings, head, norms) out of the checkpoint file's memory mapping.

    On a CPU transformers loads safetensors memory-mapped, and a weight it does not convert stays a view of the
    mapping. The quantized weights are new tensors, but these few views keep the whole float32 file mapped, with every
    page read while quantizing resident: measured on a 168M-parameter Llama (``benchmarks/qlora_memory.py``), 711 MiB
    of file-backed memory beside a 310 MiB model, enough to make QLoRA's peak higher than LoRA's. Copying them costs
    their own size once and releases the file.
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and tensor.is_floating_point():
                tensor.data = tensor.data.clone()
    return model


def keep_standard_layout(model: Any) -> Any:
    """Switch off bitsandbytes' CPU inference repacking on every 4-bit layer of ``model``; returns ``model``.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 rewrites a 4-bit layer's weights in place the first time it runs in
    eval mode without gradients (a validation, a generation): another byte layout, the block scales rounded to
    bfloat16, and the double quantization undone. It never converts back while training, so after the first
    validation every later training step computes with the rounded scales, the frozen weights' fingerprint changes
    (a resume would be refused as "another base"), and results depend on the machine's instruction set. Keeping the
    standard layout costs some CPU inference speed and makes train, eval and every machine compute the same model.
    """
    for layer in model.modules():
        if getattr(layer, "support_avx512bf16_for_cpu", False):
            layer.support_avx512bf16_for_cpu = False
    return model


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside the block (a preset's round trip through a temporary folder is not a
    download or a load the user asked for)."""
    from transformers.utils import logging as hf_logging

    was_disabled = not hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not was_disabled:
            hf_logging.enable_progress_bar()


def _checkpoint_dtype(source: str, kwargs: dict[str, Any]) -> torch.dtype:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=kwargs.get("trust_remote_code", False))
    return _config_dtype(config)


def prepare_for_training(model: Any, gradient_checkpointing: bool) -> Any:
    """peft's k-bit preparation, once: every base weight frozen, the unquantized floating-point weights (norms,
    embeddings, head) in float32 where they were 16-bit, and, with gradient checkpointing, gradients required at the
    embedding output (so the checkpointed blocks see an input that needs gradients).

    Gradient checkpointing itself stays ours (non-reentrant, see ``enable_gradient_checkpointing``): peft's preparation
    is asked not to switch it on.
    """
    import peft

    keep_standard_layout(model)  # a model quantized by the caller too
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if gradient_checkpointing:
        model.enable_input_require_grads()
    return model


def original_dtype(model: Any) -> torch.dtype:
    """The dtype the base's floating-point weights had before quantization (``config.dtype``; float32 if unset)."""
    return _config_dtype(_transformers_model(model).config)


def _config_dtype(config: Any) -> torch.dtype:
    """A transformers config's ``dtype`` as a ``torch.dtype`` (configs store a name or a dtype; float32 if unset)."""
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def merged_full_precision(model: Any, state_dict: dict | None) -> Any:
    """A standalone copy of a peft model on a quantized base with its adapter merged, in the base's original precision:
    the quantized weights are dequantized (transformers' ``dequantize``), every weight is cast back to the dtype it was
    loaded in, and the adapter is merged into that. The result has no ``quantization_config`` and loads with plain
    transformers (no bitsandbytes).

    It merges into the *dequantized* weights, the ones the adapter was trained on: the merged model's outputs equal
    the QLoRA model's up to the rounding of the merge. (Merging into the original unquantized checkpoint instead is
    ``PeftModel.from_pretrained(base, adapter).merge_and_unload()`` on the exported adapter; docs/qlora.md measures
    both.)

    Args:
        model: the ``peft.PeftModel`` being trained (left untouched: a copy is merged).
        state_dict: adapter weights to use instead of the live ones (keys as ``model.state_dict()``), or None.
    """
    import peft

    work = copy.deepcopy(model)
    if state_dict is not None:
        work.load_state_dict(state_dict, strict=False)
    name = work.active_adapter
    config, adapter = copy.deepcopy(work.peft_config[name]), peft.get_peft_model_state_dict(work, adapter_name=name)
    dtype = original_dtype(work)
    base = work.unload()
    base.dequantize()  # bitsandbytes layers -> nn.Linear; removes the quantization config
    base.to(dtype)
    for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit"):
        if hasattr(base, flag):
            setattr(base, flag, False)
    wrapped = peft.get_peft_model(base, config)
    peft.set_peft_model_state_dict(wrapped, adapter)
    return wrapped.merge_and_unload()
