"""Rows with images, for vision-language models: read lazily, checked at setup, and turned into batches by the model's
processor when each batch is built.

* :mod:`~lit_trainer.data.vision.images`: the image cells (PIL images, paths, bytes, ``datasets``' image dicts);
* :mod:`~lit_trainer.data.vision.messages`: TRL's placeholder rules for conversations;
* :mod:`~lit_trainer.data.vision.rows`: setup-time checks, the row index and the estimated ``length``;
* :mod:`~lit_trainer.data.vision.collate`: SFT batches and the pieces the other collators share
  (:func:`~lit_trainer.data.vision.collate.image_inputs`: what the modules pass to the model);
* :mod:`~lit_trainer.data.vision.preference` (DPO pairs) and :mod:`~lit_trainer.data.vision.prompt` (GRPO prompts).

The data modules switch to these paths when their rows have an ``images`` (a list per row) or ``image`` column and the
tokenizer is a vision-language model's processor (:func:`lit_trainer.models.load_processor`). See ``docs/vision.md``.
"""

from lit_trainer.data.vision.images import IMAGE_COLUMNS, image_column, image_problem, load_image, row_images
from lit_trainer.data.vision.messages import placeholder_problem, with_images

__all__ = [
    "IMAGE_COLUMNS",
    "image_column",
    "image_problem",
    "load_image",
    "placeholder_problem",
    "row_images",
    "with_images",
]
