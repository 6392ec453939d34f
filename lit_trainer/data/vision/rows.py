"""Rows with images at setup: checked without decoding an image, kept as they are (paths, bytes or PIL images: the
collator decodes them batch by batch), each given its index (``row``, for the collator's errors) and an estimated
``length`` (its text tokens plus the image tokens its images expand to) for the samplers and the position check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from datasets import Dataset
from PIL import Image
from tqdm.auto import tqdm

from lit_trainer.data.vision.images import image_problem, row_images
from lit_trainer.data.vision.messages import placeholder_problem

ROLES = ("system", "developer", "user", "assistant", "tool")
ROW_KEY = "_row"
"""The column holding each kept row's index (the collators name a bad row with it; underscored so that it does not meet
a column of the data)."""


def conversation_problem(value: Any) -> str | None:
    """What is wrong with a conversation cell whose contents may be strings or lists of ``{"type": "image"}`` /
    ``{"type": "text", "text": ...}`` parts (None when it is a valid one)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "the value is missing (an empty cell or null)"
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        return "expected a non-empty list of {'role', 'content'} messages"
    for m, message in enumerate(value):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            return f"message {m} needs a 'role' in {ROLES}"
        content = message.get("content")
        if content is None or isinstance(content, str):
            if not content and not message.get("tool_calls"):
                return f"message {m} ({message['role']}) has empty content"
            continue
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("image", "text") or (kind == "text" and not isinstance(part.get("text"), str)):
                return f"message {m}, part {p}: expected {{'type': 'image'}} or {{'type': 'text', 'text': str}}"
    return None


def image_tokens_per_image(processor: Any) -> int:
    """How many tokens one image placeholder expands to (16 for ``tiny-vl``), measured on a blank 64x64 image (exact
    for processors that resize to a fixed size, such as LLaVA's; an estimate for those whose count follows the image
    size)."""
    token = getattr(processor, "image_token", None) or "<image>"
    out = processor(text=[token], images=[Image.new("RGB", (64, 64))], add_special_tokens=False)
    alone = processor.tokenizer(token, add_special_tokens=False)["input_ids"]  # the placeholder's own token(s)
    return max(len(out["input_ids"][0]) - len(alone) + 1, 1)


def check_image_rows(
    rows: Dataset,
    image_column: str,
    where: Callable[[int], str],
    conversations: Sequence[str],
    texts: Sequence[str],
    image_token: str,
) -> None:
    """Refuse the first bad row, named with ``where(index)``: an image that cannot be read (a missing file, a value
    of the wrong type), a malformed conversation, or placeholders that do not match the row's images (in
    ``conversations``: ``{"type": "image"}`` parts; in ``texts``: the processor's ``image_token``, summed over the
    columns).

    Raises:
        ValueError: naming the row, the column and the fix.
    """
    for index in range(len(rows)):
        row = rows[index]
        images = row_images(row, image_column)
        for value in images:
            if (problem := image_problem(value)) is not None:
                raise ValueError(f"Bad image at {where(index)}, column {image_column!r}: {problem}.")
        for column in conversations:
            if (problem := conversation_problem(row[column])) is not None:
                raise ValueError(f"Bad chat row at {where(index)}, column {column!r}: {problem}. Fix or drop that row.")
        if conversations:
            cells = [turn for column in conversations for turn in row[column]]
            problem = placeholder_problem(cells, len(images))
            if problem is not None:
                raise ValueError(f"Bad image placeholders at {where(index)}: {problem}.")
        if texts:
            found = sum(str(row[column]).count(image_token) for column in texts)
            if found != len(images):
                raise ValueError(
                    f"Bad image placeholders at {where(index)}: the text holds {found} {image_token!r} for "
                    f"{len(images)} image(s). Write the image token once per image where it goes."
                )


def refuse_text_model(rows: Dataset, image_column: str, where: Callable[[int], str], what: str) -> None:
    """Rows with images for a text-only model: refused, naming the first row that has an image.

    Raises:
        ValueError: always when a row has images.
    """
    for index in range(len(rows)):
        if row_images(rows[index], image_column):
            raise ValueError(
                f"{what} has images ({where(index)}, column {image_column!r}) but the tokenizer is a text-only "
                "model's: train a vision-language model (model: tiny-vl, or a saved image-text-to-text model, whose "
                "processor the data module then loads), or drop the image column."
            )


def undecoded(rows: Dataset, column: str) -> Dataset:
    """``rows`` with ``datasets``' ``Image`` feature of ``column`` (one image or a list) set not to decode: reading a
    row then gives ``{"bytes", "path"}`` and the collator decodes it when its batch is built."""
    from datasets import Image as ImageFeature
    from datasets import List
    from datasets import Sequence as SequenceFeature

    feature = rows.features.get(column)
    if isinstance(feature, ImageFeature) and feature.decode:
        return rows.cast_column(column, ImageFeature(decode=False))
    inner = getattr(feature, "feature", None)
    if isinstance(feature, (List, SequenceFeature)) and isinstance(inner, ImageFeature) and inner.decode:
        return rows.cast_column(column, List(ImageFeature(decode=False)))
    return rows


def keep_rows(
    rows: Dataset, lengths: Callable[[Mapping[str, Any]], int], split: str, where: Callable[[int], str] | None = None
) -> Dataset:
    """``rows`` as they are, plus ``_row`` (the index, unless the rows carry their index in the dataset as given,
    before the validation split) and ``length`` (``lengths(row)``), computed once; ``where(index)`` names a row in its
    source.

    A plain loop and two added columns rather than ``Dataset.map``: ``map`` would hash the length function, and with it
    the processor, for its cache fingerprint (seconds per call), and rewrite every image into a new cache file.

    Raises:
        ValueError: ``lengths`` refused a row (its ValueError), now naming the row as the collator does.
    """
    measured = []
    for index, row in enumerate(tqdm(rows, desc=f"Measuring {split} rows", disable=len(rows) < 2000, leave=False)):
        try:
            measured.append(lengths(row))
        except ValueError as error:
            source = row.get(ROW_KEY, index)
            place = where(source) if where is not None else f"row {source} of the {split} data"
            raise ValueError(f"{place}: {error}") from error
    if ROW_KEY not in rows.column_names:
        rows = rows.add_column(ROW_KEY, list(range(len(rows))))
    return rows.add_column("length", measured)
