"""The built-in tiny vision-language preset (``tiny-vl``) and loading a vision-language model's processor.

``tiny-vl`` is a LLaVA-architecture model built from a config: a 2-layer CLIP vision tower on 32x32 images in 8x8
patches (16 image tokens per image), a projector, and the same 2-layer Llama language model as the ``tiny`` text preset,
on the presets' byte-level tokenizer with one more special token, ``<image>`` (id 384). Its processor is built in code
(a PIL image processor, so it needs neither torchvision nor a download) and saved with an export, so
``transformers.AutoProcessor`` and ``AutoModelForImageTextToText`` reload a trained model.

LLaVA rather than Qwen2-VL: transformers' Qwen2-VL processor needs a video processor, which needs torchvision; LLaVA's
needs an image processor and a tokenizer only, and its image token count is fixed by the image size it resizes to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

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

    from lit_trainer.models import build_tokenizer

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
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from lit_trainer.models import PRESETS

    tokenizer = build_processor().tokenizer
    text = PRESETS["tiny"]
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    language = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_attention_heads,
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **text_overrides,
    )
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
