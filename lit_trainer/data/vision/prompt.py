"""GRPO prompts with images: processed on the fly per batch, and their image inputs kept row by row.

:class:`VisionPromptEncoder` turns prompt rows (TRL 1.16's conversational prompts, string or structured contents, or
string prompts that hold the processor's image token once per image) into prompt token ids (image placeholders
expanded) and image inputs with the model's processor, one row at a time so an error names its row. A generation
batch repeats each prompt ``num_generations`` times in a row: a row seen twice in one batch is processed once.

A generation round's rows are shuffled and cut into micro-batches, so the image inputs must follow their rows:
:func:`pack_row_images` stores each per-image input (``pixel_values``, ``image_sizes``, ``image_grid_thw``, ...) as
a ``(rows, most entries of a row, ...)`` tensor zero-padded per row plus each row's entry count, which any row
indexing keeps aligned; :func:`model_image_inputs` concatenates the entries of the rows at hand again for the model.
Per-token inputs (``token_type_ids``, ...) are left-padded with the prompt ids and extended with zeros over the
completion, as TRL's GRPOTrainer extends them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lit_trainer.data.vision.collate import PER_IMAGE_KEYS, PER_TOKEN_KEYS, process, processor_error
from lit_trainer.data.vision.images import load_image, row_images
from lit_trainer.data.vision.messages import with_images
from lit_trainer.data.vision.rows import ROW_KEY

ROW_IMAGES = "row_images."
"""Prefix of the packed per-row image inputs: ``row_images.pixel_values`` and its ``row_images.pixel_values.count``."""
PROMPT_PER_TOKEN_KEYS = tuple(f"prompt_{key}" for key in PER_TOKEN_KEYS)
"""Per-token image inputs of the prompts, left-padded like ``prompt_ids`` (trimmed with them)."""
_COUNT = ".count"


@dataclass
class EncodedPrompt:
    """One processed prompt: token ids, image inputs, per-token inputs, its decoded images and the prompt as the
    reward functions get it (a conversation with the images filled into its placeholders, TRL 1.16's form; a string
    prompt as it is)."""

    ids: list[int]
    prompt: Any = None
    images: dict[str, Tensor] = field(default_factory=dict)
    per_token: dict[str, list[int]] = field(default_factory=dict)
    pictures: list[Any] = field(default_factory=list)


@dataclass
class VisionPromptEncoder:
    """Processes prompt rows with images (each carries ``row``, its index, and its undecoded images).

    Args:
        processor: the vision-language model's processor.
        image_column: ``images`` (a list per row) or ``image``.
        prompt_column: the prompt column.
        conversational: prompts are conversations (rendered with the processor's chat template and a generation
            prompt; string contents get their image placeholders before the first user turn, TRL's rule) rather than
            strings holding the image token.
        split: for error messages.
        drop_eos: drop an EOS the tokenizer appends to a string prompt (as the text prompts do).
        place: where a row is in its source, named in errors (default: its ``_row`` index and ``split``).
    """

    processor: Any
    image_column: str
    prompt_column: str
    conversational: bool
    split: str = "train"
    drop_eos: bool = False
    place: Callable[[Mapping[str, Any]], str] | None = None

    def where(self, row: Mapping[str, Any]) -> str:
        """The row in its source (``place``), else by its index (``_row``: before the validation split)."""
        if self.place is not None:
            return self.place(row)
        return f"row {row.get(ROW_KEY, '?')} of the {self.split} prompt data"

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> list[EncodedPrompt]:
        """The rows processed, in order; a row repeated in the batch (same ``row`` index) is processed once."""
        done: dict[Any, EncodedPrompt] = {}
        out = []
        for row in rows:
            key = row.get(ROW_KEY)
            if key is None or key not in done:
                encoded = self.encode(row)
                if key is not None:
                    done[key] = encoded
            out.append(encoded if key is None else done[key])
        return out

    def encode(self, row: Mapping[str, Any]) -> EncodedPrompt:
        where = self.where(row)
        pictures = [load_image(value, where) for value in row_images(row, self.image_column)]
        prompt = row[self.prompt_column]
        if self.conversational:
            prompt = messages = with_images(prompt, pictures, where)
            text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            out = process(self.processor, text, pictures, where)
        else:
            try:
                out = self.processor(text=[prompt], images=pictures or None, return_tensors="pt")
            except Exception as error:
                if (named := processor_error(self.processor, pictures, where, error)) is None:
                    raise
                raise named from error
        ids = out["input_ids"][0].tolist()
        per_token = {k: out[k][0].tolist() for k in PER_TOKEN_KEYS if out.get(k) is not None}
        eos = self.processor.tokenizer.eos_token_id
        if self.drop_eos and not self.conversational and ids and ids[-1] == eos:
            ids, per_token = ids[:-1], {k: v[:-1] for k, v in per_token.items()}
        images = {k: out[k] for k in PER_IMAGE_KEYS if out.get(k) is not None}
        return EncodedPrompt(ids, prompt, images, per_token, pictures)


def reward_images(encoded: Sequence[EncodedPrompt], image_column: str) -> list[Any]:
    """The ``image_column`` values the reward functions get, one per row, decoded in their own mode (not converted to
    RGB): a list of PIL images per row for ``images``, one PIL image (or None) for ``image`` (TRL 1.16 passes the
    dataset's column under its own name)."""
    if image_column == "image":
        return [e.pictures[0] if e.pictures else None for e in encoded]
    return [list(e.pictures) for e in encoded]


def pack_row_images(per_row: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Per-image inputs of each row (``processor`` outputs of one row each) as row-indexable tensors: for every key,
    ``row_images.<key>`` (rows, most entries, ...) zero-padded and ``row_images.<key>.count`` (rows,)."""
    out: dict[str, Tensor] = {}
    keys = [k for k in PER_IMAGE_KEYS if any(k in images for images in per_row)]
    for key in keys:
        parts = [images.get(key) for images in per_row]
        sample = next(p for p in parts if p is not None)
        counts = [0 if p is None else p.shape[0] for p in parts]
        shape = [max(p.shape[1:][d] for p in parts if p is not None) for d in range(sample.dim() - 1)]
        packed = sample.new_zeros((len(parts), max(counts), *shape))
        for i, part in enumerate(parts):
            if part is not None and part.shape[0]:
                packed[(i, slice(0, part.shape[0]), *(slice(0, s) for s in part.shape[1:]))] = part
        out[ROW_IMAGES + key] = packed
        out[ROW_IMAGES + key + _COUNT] = torch.tensor(counts, dtype=torch.long)
    return out


def row_image_keys(rows: Mapping[str, Any]) -> list[str]:
    """The keys of ``rows`` that hold image inputs per row (packed per-image inputs, per-token prompt inputs)."""
    return [k for k in rows if k.startswith(ROW_IMAGES) or k in PROMPT_PER_TOKEN_KEYS]


def model_image_inputs(rows: Mapping[str, Any], completion_width: int = 0) -> dict[str, Tensor]:
    """The image inputs to pass to the model with the rows' ids: every row's per-image entries concatenated in row
    order, and the per-token inputs of the prompts extended with ``completion_width`` zeros (the completion holds
    no image). Empty for rows without images."""
    out: dict[str, Tensor] = {}
    for key in PER_IMAGE_KEYS:
        packed = rows.get(ROW_IMAGES + key)
        if packed is None:
            continue
        counts = rows[ROW_IMAGES + key + _COUNT].tolist()
        if sum(counts):
            out[key] = torch.cat([packed[i, :c] for i, c in enumerate(counts) if c])
    for key, name in zip(PER_TOKEN_KEYS, PROMPT_PER_TOKEN_KEYS):
        values = rows.get(name)
        if values is not None:
            out[key] = torch.cat([values, values.new_zeros((values.shape[0], completion_width))], dim=1)
    return out
