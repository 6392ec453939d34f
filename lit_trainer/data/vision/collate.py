"""Building vision-language batches on the fly: the model's processor turns each row's text and images into token
ids (the image placeholder expanded to the model's image tokens) and pixel values, when the batch is built.

Rows are processed one at a time, so an error names its row, and then padded together. Image tokens never carry
loss (TRL 1.16's SFT collator leaves them in the labels of conversational rows); neither does padding, a prompt, or,
with ``assistant_only_loss``, a token the assistant did not write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lit_trainer.data.collate import common_prefix_len, pad_left, pad_right
from lit_trainer.data.vision.images import load_image, row_images, unprocessable_image
from lit_trainer.data.vision.messages import with_images
from lit_trainer.data.vision.rows import ROW_KEY
from lit_trainer.losses.logprobs import IGNORE_INDEX

PER_IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask", "spatial_shapes")
"""Processor outputs with one entry per image (or per image patch): concatenated over a batch's rows."""
PER_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
"""Processor outputs aligned with ``input_ids``: padded like them, with 0."""


def image_inputs(batch: Mapping[str, Any], per_token: bool = True) -> dict[str, Tensor]:
    """The image inputs of a batch (:data:`PER_IMAGE_KEYS` and, unless ``per_token=False`` as for generating from the
    batch's prompts, :data:`PER_TOKEN_KEYS`) that it has, to pass to the model."""
    keys = (*PER_IMAGE_KEYS, *PER_TOKEN_KEYS) if per_token else PER_IMAGE_KEYS
    return {key: batch[key] for key in keys if batch.get(key) is not None}


def image_token_ids(processor: Any) -> set[int]:
    """The ids of the processor's image tokens (the placeholder and, where the processor has them, the tokens that
    open and close an image): they are inputs, never targets."""
    tokenizer = processor.tokenizer
    ids = {getattr(processor, "image_token_id", None)}
    for name in ("image_token", "boi_token", "eoi_token", "vision_start_token", "vision_end_token"):
        token = getattr(processor, name, None) or getattr(tokenizer, name, None)
        if isinstance(token, str):
            ids.add(tokenizer.convert_tokens_to_ids(token))
    ids.discard(None)
    ids.discard(tokenizer.unk_token_id)
    return {int(i) for i in ids}


@dataclass
class Encoded:
    """One processed row: its token ids, which of them are targets, where the prompt ends, and its image inputs."""

    ids: list[int]
    targets: list[int]
    prompt_length: int
    images: dict[str, Tensor] = field(default_factory=dict)
    per_token: dict[str, list[int]] = field(default_factory=dict)


def process(processor: Any, text: str, images: Sequence[Any], where: str) -> dict[str, Any]:
    """``processor(text=[text], images=images)`` for one row, with a processor error naming ``where``
    (:func:`processor_error`)."""
    try:
        return processor(text=[text], images=list(images) or None, return_tensors="pt", add_special_tokens=False)
    except Exception as error:
        if (named := processor_error(processor, images, where, error)) is None:
            raise
        raise named from error


def processor_error(processor: Any, images: Sequence[Any], where: str, error: Exception) -> ValueError | None:
    """The processor's ``error`` on one row, naming ``where``: the picture that transformers' image processor fails on
    alone (its index and PIL mode) and the fix; else a ValueError (e.g. "Found 2 <image> tokens in the text but 1
    images were passed") with ``where`` in front; None for any other error (raised as it is)."""
    image_processor = getattr(processor, "image_processor", None)
    problem = unprocessable_image(image_processor, images) if images and image_processor is not None else None
    if problem is not None:
        return ValueError(
            f"{where}: {problem}. Convert that picture to a mode the processor takes (RGB, or RGBA to keep its "
            "transparency; PIL's `Image.convert`) in the dataset before training, or drop the row."
        )
    return ValueError(f"{where}: {error}") if isinstance(error, ValueError) else None


def split_row(out: Mapping[str, Any]) -> tuple[list[int], dict[str, Tensor], dict[str, list[int]]]:
    """Ids, image inputs and per-token inputs of one processed row."""
    ids = out["input_ids"][0].tolist()
    images = {k: out[k] for k in PER_IMAGE_KEYS if out.get(k) is not None}
    per_token = {k: out[k][0].tolist() for k in PER_TOKEN_KEYS if out.get(k) is not None}
    return ids, images, per_token


def truncate(encoded: Encoded, max_length: int, image_ids: set[int], where: str) -> bool:
    """Keep the first ``max_length`` tokens of a row; True when it was cut.

    Raises:
        ValueError: the cut would drop image tokens (the model needs every token of an image), naming the row and the
            length it needs.
    """
    if len(encoded.ids) <= max_length:
        return False
    if any(t in image_ids for t in encoded.ids[max_length:]):
        raise ValueError(
            f"{where}: {len(encoded.ids)} tokens with its image tokens, more than max_length={max_length}, and cutting "
            "it would cut an image. Raise max_length, or shorten the row's text before its images."
        )
    encoded.ids, encoded.targets = encoded.ids[:max_length], encoded.targets[:max_length]
    encoded.prompt_length = min(encoded.prompt_length, max_length)
    encoded.per_token = {k: v[:max_length] for k, v in encoded.per_token.items()}
    return True


def stack(
    rows: Sequence[Encoded], pad_token_id: int, pad_to_multiple_of: int | None = None, generation_inputs: bool = False
) -> dict[str, Tensor]:
    """Right-pad processed rows into a batch (``input_ids``, ``attention_mask``, ``labels``, image inputs). With
    ``generation_inputs`` and a prompt in every row, also the left-padded prompts and the completions, as the text
    collator gives for the exact-match metric (the prompts hold every image of their rows)."""
    ids = [r.ids for r in rows]
    input_ids = pad_right(ids, pad_token_id, pad_to_multiple_of)
    lengths = torch.tensor([len(s) for s in ids])
    attention_mask = (torch.arange(input_ids.size(1))[None, :] < lengths[:, None]).long()
    targets = pad_right([r.targets for r in rows], 0, pad_to_multiple_of).bool()
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(~targets, IGNORE_INDEX),
    }
    for key in PER_IMAGE_KEYS:
        parts = [r.images[key] for r in rows if key in r.images]
        if parts:
            batch[key] = torch.cat(parts)
    for key in PER_TOKEN_KEYS:
        if any(key in r.per_token for r in rows):
            batch[key] = pad_right([r.per_token.get(key, [0] * len(r.ids)) for r in rows], 0, pad_to_multiple_of)
    if generation_inputs and all(r.prompt_length > 0 for r in rows):
        prompts = [r.ids[: r.prompt_length] for r in rows]
        batch["prompt_input_ids"] = pad_left(prompts, pad_token_id)
        batch["prompt_attention_mask"] = pad_left([[1] * len(p) for p in prompts], 0)
        batch["completion_ids"] = pad_right([r.ids[r.prompt_length :] for r in rows], IGNORE_INDEX)
    return batch


class RowCollator:
    """What the collators of rows with images share (mixed into their dataclasses, which give ``processor`` and
    ``split``): the image token ids, the pad id, and how an error names a row."""

    processor: Any
    split: str
    place: Callable[[Mapping[str, Any]], str] | None  # where a row is in its source (the data module's row_place)

    def __post_init__(self) -> None:
        self.image_ids = image_token_ids(self.processor)
        tokenizer = self.processor.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def where(self, row: Mapping[str, Any]) -> str:
        """The row in its source (``place``), else by its index (``_row``: before the validation split)."""
        return self.place(row) if self.place is not None else f"row {row.get(ROW_KEY, '?')} of the {self.split} data"


@dataclass
class VisionSFTCollator(RowCollator):
    """SFT batches of rows with images (TRL 1.16's formats), processed when the batch is built.

    Row formats (the ``fmt`` names of :class:`~lit_trainer.data.SFTDataModule`):

    * ``messages``: a conversation; trained on every token but the image tokens, or on the assistant's tokens with
      ``assistant_only_loss``;
    * ``chat_prompt_completion``: conversations as prompt and completion; trained on the completion;
    * ``text`` / ``prompt_completion``: strings that hold the processor's image token once per image (``<image>``
      for ``tiny-vl``); an EOS ends each row as for text rows.

    Each row carries ``_row`` (its index in the dataset as given, named in errors by ``place``) and its undecoded
    images in ``image_column``.
    """

    processor: Any
    fmt: str
    columns: Mapping[str, str]  # text / prompt / completion / messages column names
    image_column: str | None
    max_length: int
    split: str = "train"
    assistant_only_loss: bool = False
    pad_to_multiple_of: int | None = None
    generation_inputs: bool = False
    place: Callable[[Mapping[str, Any]], str] | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        encoded = [self.encode(row) for row in rows]
        for row, enc in zip(rows, encoded):
            truncate(enc, self.max_length, self.image_ids, self.where(row))
        return stack(encoded, self.pad_token_id, self.pad_to_multiple_of, self.generation_inputs)

    def encode(self, row: Mapping[str, Any]) -> Encoded:
        where = self.where(row)
        images = [load_image(value, where) for value in row_images(row, self.image_column)]
        if self.fmt in ("messages", "chat_prompt_completion"):
            enc = self._encode_chat(row, images, where)
        else:
            enc = self._encode_text(row, images, where)
        enc.targets = [0 if t in self.image_ids else m for t, m in zip(enc.ids, enc.targets)]
        return enc

    def _render(self, messages: list[dict[str, Any]], **options: Any) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, **options)

    def _encode_chat(self, row: Mapping[str, Any], images: list[Any], where: str) -> Encoded:
        cols = self.columns
        if self.fmt == "messages":
            messages = with_images(row[cols["messages"]], images, where)
            # the prompt (where the last answer starts) serves only the exact-match generation: processing it costs a
            # second pass of the row's images through the processor, so training batches skip it
            ends_with_answer = self.generation_inputs and messages[-1].get("role") == "assistant"
            prompt = self._render(messages[:-1], add_generation_prompt=True) if ends_with_answer else None
        else:
            prompt_turns = with_images(row[cols["prompt"]], images, where)
            messages = prompt_turns + with_images(row[cols["completion"]], [], where)
            prompt = self._render(prompt_turns, add_generation_prompt=True)
        if self.assistant_only_loss:
            out = self.processor.apply_chat_template(
                [messages],
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                return_assistant_tokens_mask=True,
                processor_kwargs={"add_special_tokens": False},
            )
            targets = out["assistant_masks"][0].tolist()
        else:
            out = process(self.processor, self._render(messages), images, where)
            targets = None
        ids, image_inputs_, per_token = split_row(out)
        targets = [1] * len(ids) if targets is None else [int(t) for t in targets]
        plen = 0
        if prompt is not None:
            plen = common_prefix_len(process(self.processor, prompt, images, where)["input_ids"][0].tolist(), ids)
        if self.fmt == "chat_prompt_completion":
            targets = [0] * plen + targets[plen:]
        return Encoded(ids, targets, plen, image_inputs_, per_token)

    def _encode_text(self, row: Mapping[str, Any], images: list[Any], where: str) -> Encoded:
        cols, eos = self.columns, self.processor.tokenizer.eos_token_id
        if self.fmt == "text":
            prompt, text = "", row[cols["text"]]
        else:
            prompt, text = row[cols["prompt"]], row[cols["prompt"]] + row[cols["completion"]]
        ids, image_inputs_, per_token = split_row(process(self.processor, text, images, where))
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
            per_token = {k: v + [0] for k, v in per_token.items()}
        plen = 0
        if prompt:
            plen = common_prefix_len(process(self.processor, prompt, images, where)["input_ids"][0].tolist(), ids)
        return Encoded(ids, [0] * plen + [1] * (len(ids) - plen), plen, image_inputs_, per_token)
