"""Images of a row: read lazily from what a dataset holds (PIL images, paths, bytes, or ``datasets``' ``{"bytes",
"path"}`` dicts), decoded only when a batch is built, and never cached: a decoded image lives as long as its batch is
being processed.

A decoded image keeps its own mode (RGBA, P, LA, L, I;16, CMYK, ...), as ``datasets`` decodes it and TRL 1.16 hands it
on: the model's processor converts it to RGB exactly as it does at inference (transformers' ``convert_to_rgb``
composites transparency onto white; PIL's ``convert("RGB")`` would turn it black), and the reward functions get the
picture as it is.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

IMAGE_COLUMNS = ("images", "image")
"""TRL's image columns: ``images`` holds a list per row, ``image`` a single image."""


def image_column(columns: Sequence[str]) -> str | None:
    """The image column among ``columns`` (``images`` before ``image``), or None for text-only data."""
    return next((name for name in IMAGE_COLUMNS if name in columns), None)


def row_images(row: Mapping[str, Any], column: str | None) -> list[Any]:
    """The images of ``row`` as a list (``image``: one; ``images``: its list; none: empty), still undecoded."""
    if column is None:
        return []
    value = row.get(column)
    if value is None:
        return []
    if column == "image" or isinstance(value, (str, bytes, Image.Image, Mapping)):
        return [value]
    return list(value)


def image_problem(value: Any) -> str | None:
    """What is wrong with an image cell that can be told without decoding it (a path that does not exist, a value of
    the wrong type), or None."""
    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            return None
        value = value.get("path")
        if value is None:
            return "an image dict with neither 'bytes' nor 'path'"
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        return None if path.is_file() else f"the image file {str(value)!r} does not exist"
    if isinstance(value, (bytes, bytearray, Image.Image)):
        return None
    return f"an image must be a PIL image, a path or bytes, got {type(value).__name__}"


def load_image(value: Any, where: str) -> Image.Image:
    """Decode one image cell into a PIL image in its own mode (a PIL image is returned as it is): the processor
    converts it, as transformers does at inference.

    Raises:
        ValueError: a missing file, bytes or a file that do not decode as an image, or a value of another type; the
            message names ``where`` (the row).
    """
    problem = image_problem(value)
    if problem is not None:
        raise ValueError(f"{where}: {problem}.")
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, Mapping):
        value = value["bytes"] if value.get("bytes") is not None else value["path"]
    source = io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else Path(value).expanduser()
    try:
        with Image.open(source) as image:
            image.load()  # the pixels (of the first frame) read now, so that closing the file keeps them
            return image
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        what = f"the file {str(value)!r} does" if isinstance(source, Path) else f"{len(value)} bytes do"
        raise ValueError(f"{where}: {what} not decode as an image ({error}).") from error


def unprocessable_image(image_processor: Any, images: Sequence[Image.Image]) -> str | None:
    """Which of ``images`` the processor's ``image_processor`` fails on, processed alone (its index, PIL mode and
    size, and transformers' error), or None when each one passes (the failure was not an image's)."""
    for index, image in enumerate(images):
        try:
            image_processor(images=[image], return_tensors="pt")
        except Exception as error:  # any failure of transformers on this picture is the one to report
            mode, size = getattr(image, "mode", "?"), "x".join(map(str, getattr(image, "size", ())))
            return f"image {index} (PIL mode {mode!r}, {size}) fails in the model's image processor: {error}"
    return None
