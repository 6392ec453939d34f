"""Vision-language models: the ``tiny-vl`` preset, processors, images in rows, and batches built on the fly.

Data modules switch to these paths when their rows have an ``images`` (a list per row) or ``image`` column and their
tokenizer is a vision-language model's processor; the modules pass the batch's image inputs (:func:`image_inputs`) to
the model with the token ids (batches: :mod:`lit_trainer.vision.collate`, imported where used: it needs the data
package, which needs :mod:`lit_trainer.models`, which needs the presets here). See ``docs/vision.md``.
"""

from lit_trainer.vision.images import IMAGE_COLUMNS, image_column, image_problem, load_image, row_images
from lit_trainer.vision.messages import placeholder_problem, with_images
from lit_trainer.vision.presets import (
    VISION_PRESET,
    build_processor,
    build_vision_preset,
    is_processor,
    is_vision_checkpoint,
    is_vision_model,
    is_vision_preset,
    is_vision_source,
    load_processor,
    load_vision_model,
)

__all__ = [
    "IMAGE_COLUMNS",
    "VISION_PRESET",
    "build_processor",
    "build_vision_preset",
    "image_column",
    "image_problem",
    "is_processor",
    "is_vision_checkpoint",
    "is_vision_model",
    "is_vision_preset",
    "is_vision_source",
    "load_image",
    "load_processor",
    "load_vision_model",
    "placeholder_problem",
    "row_images",
    "with_images",
]
