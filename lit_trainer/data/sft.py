"""SFTDataModule: plain text, prompt/completion or chat rows for causal-LM fine-tuning."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_trainer.data import builtin, builtin_shapes, vision
from lit_trainer.data.base import BaseDataModule, BuiltinSources
from lit_trainer.data.chat import (
    assistant_tokens,
    conversation_problem,
    is_conversation,
    render,
    require_chat_template,
    template_options,
)
from lit_trainer.data.collate import PackedCollator, SFTCollator, common_prefix_len
from lit_trainer.data.packing import PACKED_ROWS, Packing, check_packing_options, pack_dataset
from lit_trainer.data.reasoning_gym import TaskRows
from lit_trainer.data.sources import Locator, check_cells, describe_columns, missing_or_not_text
from lit_trainer.data.vision import rows as vision_rows
from lit_trainer.data.vision.collate import VisionSFTCollator
from lit_trainer.losses.causal_lm import count_target_tokens

RowFormat = Literal["text", "prompt_completion", "messages", "chat_prompt_completion"]
CHAT_FORMATS = ("messages", "chat_prompt_completion")


def _encode_chat(
    tok: Any, row: dict[str, Any], fmt: str, columns: dict[str, str], assistant_only_loss: bool
) -> tuple[list[int], int, list[int]]:
    """``(ids, prompt_length, loss_mask)`` of one conversation; ``prompt_length`` is where the last assistant
    turn's text starts (the exact-match prompt), 0 when the conversation does not end with the assistant."""
    options = template_options(row)
    if fmt == "messages":
        messages = list(row[columns["messages"]])
        ends_with_answer = messages[-1].get("role") == "assistant"
        prompt = render(tok, messages[:-1], add_generation_prompt=True, **options) if ends_with_answer else []
    else:  # conversational prompt/completion: the completion's tokens only, as for string rows
        messages = list(row[columns["prompt"]]) + list(row[columns["completion"]])
        prompt = render(tok, row[columns["prompt"]], add_generation_prompt=True, **options)
    ids, mask = (
        assistant_tokens(tok, messages, options) if assistant_only_loss else (render(tok, messages, **options), None)
    )
    plen = common_prefix_len(prompt, ids)
    mask = [1] * len(ids) if mask is None else mask
    if fmt == "chat_prompt_completion":
        mask = [0] * plen + mask[plen:]
    return ids, plen, mask


def _encode_text(
    tok: Any, batch: dict[str, list], fmt: str, columns: dict[str, str]
) -> list[tuple[list[int], int, None]]:
    eos = tok.eos_token_id
    if fmt == "text":
        full = tok(batch[columns["text"]])["input_ids"]
        prompt_lengths = [0] * len(full)
    else:
        prompts = batch[columns["prompt"]]
        full = tok([p + c for p, c in zip(prompts, batch[columns["completion"]])])["input_ids"]
        prompt_ids = tok(prompts)["input_ids"]
        prompt_lengths = [common_prefix_len(p, f) for p, f in zip(prompt_ids, full)]
    full = [ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids for ids in full]
    return [(ids, plen, None) for ids, plen in zip(full, prompt_lengths)]


def _empty_completions(
    batch: dict[str, list], fmt: str, columns: dict[str, str], masks: list[list[int] | None]
) -> list[bool]:
    """Per row: nothing of its own to learn (an empty text or completion string; a chat row without a trained
    token before truncation, i.e. without an assistant message under ``assistant_only_loss``)."""
    if fmt in CHAT_FORMATS:
        return [sum(mask) == 0 for mask in masks]
    return [value == "" for value in batch[columns["text" if fmt == "text" else "completion"]]]


def tokenize_rows(
    batch: dict[str, list],
    *,
    tokenizer: Any,
    fmt: RowFormat,
    columns: dict[str, str],
    assistant_only_loss: bool,
    max_length: int,
) -> dict[str, list]:
    """A batch of SFT rows tokenized: ``input_ids``, ``prompt_length``, ``length``, ``truncated``, ``targets``,
    ``empty`` (and ``loss_mask`` for chat rows), each row cut to ``max_length``.

    A module-level function, given its options as ``Dataset.map``'s ``fn_kwargs``: ``datasets`` pickles the mapped
    function and its arguments for the cache fingerprint, and a closure over the data module would pickle the
    module, its trainer and the model with it (issue 48). ``columns`` maps ``text``/``prompt``/``completion``/
    ``messages`` to the column names.
    """
    if fmt in CHAT_FORMATS:
        rows = [{key: values[i] for key, values in batch.items()} for i in range(len(next(iter(batch.values()))))]
        encoded = [_encode_chat(tokenizer, row, fmt, columns, assistant_only_loss) for row in rows]
    else:
        encoded = _encode_text(tokenizer, batch, fmt, columns)
    out: dict[str, list] = {"input_ids": [], "prompt_length": [], "length": [], "truncated": [], "targets": []}
    out["empty"] = _empty_completions(batch, fmt, columns, [mask for _, _, mask in encoded])
    if fmt in CHAT_FORMATS:
        out["loss_mask"] = [mask[:max_length] for _, _, mask in encoded]
    for ids, plen, mask in encoded:
        out["truncated"].append(len(ids) > max_length)
        ids = ids[:max_length]
        out["input_ids"].append(ids)
        out["prompt_length"].append(min(plen, len(ids)))
        out["length"].append(len(ids))
        out["targets"].append(sum(mask[:max_length]) if mask is not None else len(ids) - plen)
    return out


class SFTDataModule(BaseDataModule):
    """Supervised fine-tuning data: a ``text`` column, ``prompt`` + ``completion`` columns, or a ``messages`` column.

    Text rows are trained on every token. Prompt/completion rows are trained on the completion only (the prompt's
    labels are ``-100``), with the prompt boundary found as the common prefix of ``tok(prompt)`` and
    ``tok(prompt + completion)`` (so BOS/EOS conventions of any tokenizer are respected). An EOS token ends every
    string row. Rows longer than ``max_length`` are truncated (kept from the start) and counted; rows left without
    any target token (the prompt alone fills ``max_length``) are dropped and counted. A ``length`` column is added
    once. Rows with nothing of their own to learn (an empty text or completion; a conversation without an assistant
    message under ``assistant_only_loss``) are counted and warned about, and a split made only of them is refused.

    Chat rows (TRL SFTTrainer's formats) are rendered with the tokenizer's chat template, passing on the row's
    optional ``tools`` and ``chat_template_kwargs`` columns; the template ends the turns (no EOS is added):

    * ``messages``: a list of ``{"role", "content"}`` messages, trained on every token, or only on the assistant's
      tokens with ``assistant_only_loss=True``;
    * ``prompt`` + ``completion`` columns whose cells are message lists: trained on the completion's tokens (those
      after ``render(prompt, add_generation_prompt=True)``), and only on its assistant tokens with
      ``assistant_only_loss``.

    The assistant's tokens are found with the template's ``{% generation %}`` markers, or else by rendering turn by
    turn (see :mod:`lit_trainer.data.chat`); a template for which neither works is refused. For validation exact
    match, a conversation's prompt is everything before its last assistant turn's text. Roles are checked before any
    tokenization: a malformed conversation (not a list, a message without role or with an unknown role, empty
    content) is reported with its row (file and line for local files).

    Args:
        text_column: name of the plain-text column.
        prompt_column: name of the prompt column.
        completion_column: name of the completion column.
        messages_column: name of the conversation column.
        assistant_only_loss: train chat rows on the assistant's tokens only (refused for string rows).
        pad_to_multiple_of: round padded lengths up to a multiple.
        packing: training batches as ``"none"`` (right-padded), ``"padding_free"`` (each micro-batch's
            ``batch_size`` rows flattened into one row, ``position_ids`` restarting per row, no padding) or ``"bfd"``
            (rows grouped at setup into bins of ``max_length`` tokens by best-fit decreasing; ``batch_size`` bins per
            micro-batch, each bin one row). Chat rows keep their loss mask when packed. Validation batches stay padded.
            See :mod:`lit_trainer.data.packing`.
        max_tokens_per_batch: with ``packing="bfd"``, the bin size in tokens (>= ``max_length``) with one bin per
            micro-batch (``batch_size`` must be 1): the micro-batch token budget. Unset: bins of ``max_length``.
        **kwargs: the options of :class:`~lit_trainer.data.base.BaseDataModule` (``tokenizer``, ``dataset``,
            ``max_length``, ``batch_size``, ``sampling``, DataLoader options, ...).

    Example::

        dm = SFTDataModule(tokenizer="tiny", dataset="builtin:addition", batch_size=64, max_length=32)
        trainer.fit(CausalLMModule("tiny"), datamodule=dm)
        chat = SFTDataModule(dataset="builtin:addition_chat", assistant_only_loss=True, max_length=128)
    """

    builtin: ClassVar[BuiltinSources] = {
        "builtin:addition": builtin.sft_rows,
        "builtin:addition_chat": builtin.sft_chat_rows,
        "builtin:tool_addition_chat": builtin.tool_addition_chat_rows,
        "builtin:tool_multiplication_chat": builtin.tool_multiplication_chat_rows,
        "builtin:subtraction": builtin.subtraction_rows,
        "builtin:shapes": builtin_shapes.sft_rows,
    }
    task_rows: ClassVar[TaskRows | None] = "sft"

    def __init__(
        self,
        *args: Any,
        text_column: str = "text",
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        messages_column: str = "messages",
        assistant_only_loss: bool = False,
        pad_to_multiple_of: int | None = None,
        packing: Packing = "none",
        max_tokens_per_batch: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_packing_options(packing, max_tokens_per_batch, self.hparams)
        self.save_hyperparameters(ignore=["tokenizer", "dataset", "validation_dataset"])
        self._vision: tuple[RowFormat, str] | None = None  # (row format, image column) of rows with images

    def _row_format(self, rows: Dataset, split: str) -> RowFormat:
        hp, columns = self.hparams, rows.column_names
        if hp.prompt_column in columns and hp.completion_column in columns:
            chat = len(rows) > 0 and is_conversation(rows[0][hp.prompt_column])
            fmt: RowFormat = "chat_prompt_completion" if chat else "prompt_completion"
        elif hp.messages_column in columns:
            fmt = "messages"
        elif hp.text_column in columns:
            fmt = "text"
        else:
            raise ValueError(
                f"The {split} data has no {hp.text_column!r} column, no {hp.messages_column!r} column and no "
                f"{hp.prompt_column!r} + {hp.completion_column!r} columns (it has {describe_columns(rows)}). Rename "
                "your columns or set `text_column` / `messages_column` / `prompt_column` / `completion_column`."
            )
        if hp.assistant_only_loss and fmt not in CHAT_FORMATS:
            raise ValueError(
                f"`assistant_only_loss=True` needs conversations, but the {split} rows are plain "
                f"{fmt.replace('_', '/')} strings: give a {hp.messages_column!r} column (or message "
                "lists as prompt/completion), or set `assistant_only_loss=False`."
            )
        return fmt

    def _column_names(self) -> dict[str, str]:
        """``text``/``prompt``/``completion``/``messages`` -> the column names of this data module."""
        hp = self.hparams
        return {
            "text": hp.text_column, "prompt": hp.prompt_column, "completion": hp.completion_column,
            "messages": hp.messages_column,
        }  # fmt: skip

    def _columns(self, fmt: RowFormat) -> tuple[str, ...]:
        hp = self.hparams
        return {"text": (hp.text_column,), "messages": (hp.messages_column,)}.get(
            fmt, (hp.prompt_column, hp.completion_column)
        )

    @override
    def _check_rows(self, rows: Dataset, split: str, where: Locator) -> None:
        fmt = self._row_format(rows, split)
        columns = self._columns(fmt)
        if (images := vision.image_column(rows.column_names)) is not None:
            if self.processor is not None:
                return self._check_image_rows(rows, images, where, fmt)
            # a text-only model: refused when a row has an image; an image column without any image is ignored
            vision_rows.refuse_text_model(vision_rows.undecoded(rows, images), images, where, f"The SFT {split} data")
        if fmt in CHAT_FORMATS:
            check_cells(rows, columns, where, conversation_problem, "chat row")
            require_chat_template(self.tokenizer, f"The SFT {split} data")
        else:
            check_cells(rows, columns, where, missing_or_not_text, "SFT row")

    def _check_empty(self, data: Dataset, split: str, fmt: str) -> None:
        """Refuse a split whose every row has nothing to learn; count the rows that have nothing and warn."""
        hp = self.hparams
        empty, total = sum(data["empty"]), len(data)
        self.stats[f"{split}_rows_empty_completion"] = empty
        if fmt == "messages":
            what = "no assistant message, and `assistant_only_loss=True` trains on the assistant's tokens only"
            fix = "Add the assistant turns, or set assistant_only_loss=False (to train on every token)."
        else:
            option = "text_column" if fmt == "text" else "completion_column"
            what = f"an empty {hp[option]!r}"
            fix = f"Fill it, or set `{option}` to the column that holds the text to learn."
        if empty == total:
            raise ValueError(f"All {total} {split} rows have {what}: there is nothing to learn. {fix}")
        if empty:
            rank_zero_warn(
                f"[lit_trainer] {split}: {empty} of {total} {split} rows have {what}: they teach nothing but where "
                "the text ends."
            )

    @override
    def _preprocess(self, rows: Dataset, split: str) -> Dataset:
        fmt = self._row_format(rows, split)
        self._require_rows(rows, split)
        if self.processor is not None and (images := vision.image_column(rows.column_names)) is not None:
            if self.hparams.packing != "none":
                raise ValueError(
                    f"`packing={self.hparams.packing!r}` is not supported for rows with images: a packed row would "
                    "need each image's tokens kept whole inside one bin and every image of a bin passed with it in "
                    "order, which no vision-language model's forward checks. Set packing='none' (TRL and Axolotl do "
                    "not pack images either)."
                )
            self._vision = (fmt, images)
            return self._keep_image_rows(rows, split, images, fmt)
        keep = ["answer"] if "answer" in rows.column_names else []
        hp = self.hparams
        options = {"fmt": fmt, "columns": self._column_names(), "assistant_only_loss": hp.assistant_only_loss}
        data = rows.map(
            tokenize_rows,
            batched=True,
            fn_kwargs={"tokenizer": self.tokenizer, "max_length": hp.max_length, **options},
            remove_columns=[c for c in rows.column_names if c not in keep],
            desc=f"Tokenizing {split}",
        )
        self._check_empty(data, split, fmt)
        truncated = sum(data["truncated"])
        usable = data.filter(lambda b: [n > 0 for n in b["targets"]], batched=True)
        dropped = len(data) - len(usable)
        self._count_filtered(
            split,
            truncated,
            ("dropped_without_target", dropped),
            f"{truncated} rows longer than max_length={self.hparams.max_length} were truncated; {dropped} rows had "
            "no completion token left and were dropped.",
        )
        if len(usable) == 0:
            raise ValueError(
                f"No {split} row has a completion token within max_length={self.hparams.max_length}: "
                "raise max_length or shorten the prompts."
            )
        usable = usable.remove_columns(["truncated", "targets", "empty"])
        if split == "train" and self.hparams.packing == "bfd":
            self.stats[PACKED_ROWS] = len(usable)  # the report counts these rows, not the bins they fill
            usable = pack_dataset(
                usable, self.hparams.max_tokens_per_batch or self.hparams.max_length, self.hparams.length_column_name
            )
        return usable

    def _image_row_length(self, fmt: RowFormat, images: str) -> Callable[[dict[str, Any]], int]:
        """A row's length as its batch will hold it, without decoding its images: the tokens of its rendered text
        (``add_special_tokens=False``, as the collator processes it), each image token counted as the tokens it
        expands to, the EOS a string row gets, at most ``max_length`` (a longer row is cut after its images; one whose
        cut would fall inside an image is refused here, naming the row)."""
        tok, processor, limit = self.tokenizer, self.processor, self.hparams.max_length
        per_image = vision_rows.image_tokens_per_image(processor)
        image_id = tok.convert_tokens_to_ids(getattr(processor, "image_token", None) or "<image>")
        eos = tok.eos_token_id

        def length(row: dict[str, Any]) -> int:
            if fmt in CHAT_FORMATS:
                count = len(vision.row_images(row, images))
                turns = vision.with_images([t for c in self._columns(fmt) for t in row[c]], [None] * count, "row")
                text = processor.apply_chat_template(turns, tokenize=False)
            else:
                text = "".join(row[c] for c in self._columns(fmt))
            ids = tok(text, add_special_tokens=False)["input_ids"]
            placeholders = [i for i, t in enumerate(ids) if t == image_id]
            total = len(ids) + len(placeholders) * (per_image - 1)
            if fmt not in CHAT_FORMATS and eos is not None and (not ids or ids[-1] != eos):
                total += 1  # the EOS that ends a string row
            if placeholders and placeholders[-1] + 1 + len(placeholders) * (per_image - 1) > limit:
                raise ValueError(  # refused now rather than when its batch comes (the collator checks it too)
                    f"{total} tokens with its image tokens, more than max_length={limit}, and cutting it would cut "
                    "an image. Raise max_length, or shorten the row's text before its images."
                )
            return min(total, limit)

        return length

    def _check_image_rows(self, rows: Dataset, images: str, where: Locator, fmt: RowFormat) -> None:
        chat = fmt in CHAT_FORMATS
        vision_rows.check_image_rows(
            vision_rows.undecoded(rows, images), images, where,
            conversations=self._columns(fmt) if chat else (), texts=() if chat else self._columns(fmt),
            image_token=getattr(self.processor, "image_token", "<image>"),
        )  # fmt: skip

    def _keep_image_rows(self, rows: Dataset, split: str, images: str, fmt: RowFormat) -> Dataset:
        rows = vision_rows.undecoded(rows, images)
        return vision_rows.keep_rows(rows, self._image_row_length(fmt, images), split, self.locators.get(split))

    @override
    def _collate(self, rows: list[dict[str, Any]], train: bool) -> dict[str, torch.Tensor]:
        if self._vision is not None:
            fmt, images = self._vision
            hp = self.hparams
            split = "train" if train else "validation"
            place = functools.partial(self.row_place, split=split)
            return VisionSFTCollator(
                self.processor, fmt, self._column_names(), images, hp.max_length, split, hp.assistant_only_loss,
                hp.pad_to_multiple_of, generation_inputs=not train, place=place,
            )(rows)  # fmt: skip
        if train and self.hparams.packing != "none":
            return PackedCollator(self.pad_token_id)(rows)
        collator = SFTCollator(self.pad_token_id, self.hparams.pad_to_multiple_of, generation_inputs=not train)
        return collator(rows)

    def longest_prompt(self) -> int | None:
        """Tokens of the longest prompt (before the first trained token) over the training and validation rows; None
        before setup or for rows without a ``prompt_length`` column (packed bins). On-policy distillation samples
        completions after the prompts and compares this plus its budget with the model's positions."""
        lengths = [
            max(data["prompt_length"])
            for data in (self.train_dataset, self.val_dataset)
            if data is not None and len(data) and "prompt_length" in data.column_names
        ]
        return max(lengths) if lengths else None

    @override
    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Target tokens after the causal shift."""
        return count_target_tokens(batch["labels"])
