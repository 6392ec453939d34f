"""PromptDataModule: prompts (plus reward columns) for online RL (GRPO), in the reference's RepeatSampler order.

The training loader yields, for every micro-step, the prompts of this rank's whole **local generation batch**
(``per_device_batch_size x steps_per_generation`` rows, each prompt repeated ``num_generations`` times in a row), and
the same batch ``num_iterations x steps_per_generation`` times in a row, exactly as the reference's dataloader
(docs/design.md#trl-grpo). The module generates on the first micro-step of each round and serves the following
micro-steps from its buffer. The loader is a :class:`~lit_trainer.data.loader.TrainLoader`, so it is resumable and
Lightning does not re-shard it; under DDP each rank gets its contiguous slice of every generation batch and
generates for its own prompts.

The geometry (``num_generations``, ``steps_per_generation``, ``num_iterations``) belongs to the LightningModule (as
in the reference's ``GRPOConfig``): :meth:`PromptDataModule.train_dataloader` reads the module's
``rollout_geometry`` attribute (a :class:`RolloutGeometry`, duck-typed) once the Trainer is attached;
:meth:`PromptDataModule.generation_loader` builds the same loader from explicit values.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any, ClassVar, Literal, NamedTuple, get_args

from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_trainer.data import builtin, builtin_shapes, vision
from lit_trainer.data.base import BaseDataModule, BuiltinSources
from lit_trainer.data.chat import is_conversation, render, require_chat_template
from lit_trainer.data.collate import pad_left
from lit_trainer.data.loader import TrainLoader
from lit_trainer.data.reasoning_gym import TaskRows
from lit_trainer.data.samplers.batch_sampler import EpochPosition
from lit_trainer.data.samplers.repeat_sampler import RepeatSampler
from lit_trainer.data.sources import Locator, check_cells, describe_columns, missing_or_not_text
from lit_trainer.data.vision import rows as vision_rows
from lit_trainer.data.vision.collate import PER_TOKEN_KEYS
from lit_trainer.data.vision.prompt import (
    PROMPT_PER_TOKEN_KEYS,
    VisionPromptEncoder,
    pack_row_images,
    reward_images,
)
from lit_trainer.data.vision.rows import ROW_KEY

PROMPT_IDS = "prompt_input_ids"
PROMPT_MASK = "prompt_attention_mask"
PROMPTS = "prompts"
REWARD_COLUMNS = "reward_columns"
PromptSampling = Literal["random", "sequential"]  # the `sampling` values that apply to prompts
_EXCLUDED_COLUMNS = ("completion", "completion_ids", PROMPT_IDS)  # never passed to reward functions (as reference)


class RolloutGeometry(NamedTuple):
    """Resolved GRPO batch geometry (TRL's ``GRPOConfig`` rules), published by the module as ``rollout_geometry``."""

    num_generations: int
    steps_per_generation: int
    generation_batch_size: int
    num_iterations: int


class GenerationBatchSampler(EpochPosition):
    """Cuts this rank's :class:`RepeatSampler` stream into micro-batches of one local generation batch each.

    A :class:`~lit_trainer.data.samplers.BatchSampler` (rank-aware, equal length on every rank); its epoch and
    resume position (in micro-batches) are its :class:`~lit_trainer.data.samplers.EpochPosition`, and the
    RepeatSampler only supplies each epoch's index list.

    Args:
        sampler: the rank's RepeatSampler (``repeat_count = num_iterations * steps_per_generation``).
        rows: ``per_device_batch_size * steps_per_generation`` (indices per yielded list).
    """

    def __init__(self, sampler: RepeatSampler, rows: int) -> None:
        self.sampler = sampler
        self.rows = rows

    def _iter_from(self, start: int) -> Iterator[list[int]]:
        self.sampler.set_epoch(self.epoch)
        indices = self.sampler.indices()
        return (indices[i : i + self.rows] for i in range(start * self.rows, len(indices), self.rows))

    def __len__(self) -> int:
        return len(self.sampler) // self.rows

    def batch_indices(self, epoch: int, index: int) -> list[int] | None:
        """The dataset indices of micro-batch ``index`` of ``epoch`` (None past the epoch's end), without moving this
        sampler: what an asynchronous rollout worker reads ahead."""
        if index >= len(self):
            return None
        cached = getattr(self, "_ahead", None)
        if cached is None or cached[0] != epoch:  # one epoch's order, drawn once (a permutation of the dataset)
            sampler = copy.copy(self.sampler)
            sampler.set_epoch(epoch)
            self._ahead = cached = (epoch, sampler.indices())
        return cached[1][index * self.rows : (index + 1) * self.rows]


def _prompt_problem(prompt: Any) -> str | None:
    return None if is_conversation(prompt) else missing_or_not_text(prompt)


def missing_or_not_text_or_conversation(prompt: Any) -> str | None:
    """A prompt next to images: a conversation (string or structured contents), or a string."""
    return vision_rows.conversation_problem(prompt) if is_conversation(prompt) else missing_or_not_text(prompt)


def appends_eos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` ends every encoding with an EOS it adds itself (ByT5 does)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        return False
    return tokenizer("a")["input_ids"] == tokenizer("a", add_special_tokens=False)["input_ids"] + [eos]


def prompt_token_ids(tokenizer: Any, prompts: list[Any], *, conversational: bool, drop_eos: bool) -> list[list[int]]:
    """The ids of ``prompts``: the chat template with the generation prompt for conversations, else the tokenizer's
    default special tokens, without the EOS it appends when ``drop_eos``."""
    if conversational:
        return [render(tokenizer, p, add_generation_prompt=True) for p in prompts]
    ids = tokenizer(prompts)["input_ids"]
    return [row[:-1] for row in ids] if drop_eos else ids


def tokenize_prompts(
    batch: dict[str, list], *, tokenizer: Any, column: str, conversational: bool, drop_eos: bool
) -> dict[str, list]:
    """A batch of prompts tokenized: ``prompt_input_ids`` and ``length``. Module-level and given its options as
    ``fn_kwargs``: ``datasets`` pickles the mapped function for its cache fingerprint, and a closure over the data
    module pickled the module with its trainer and model (issue 48)."""
    ids = prompt_token_ids(tokenizer, batch[column], conversational=conversational, drop_eos=drop_eos)
    return {PROMPT_IDS: ids, "length": [len(i) for i in ids]}


class PromptDataModule(BaseDataModule):
    """Prompts for GRPO: a prompt column, plus any other columns, passed to the reward functions row by row.

    * Standard prompts (strings) are tokenized with the tokenizer's default special tokens (a BOS is kept), except
      that an EOS the tokenizer appends (``ByT5Tokenizer`` does; the presets' tokenizer does not) is dropped: a
      prompt must not end the text before the completion starts. TRL's GRPOTrainer keeps that EOS, which makes a
      byte-level model trained by SFT on ``prompt + completion`` see an unfamiliar ``</s>`` before its answer.
    * Conversational prompts (lists of ``{"role", "content"}`` messages) go through the tokenizer's chat template
      with ``add_generation_prompt=True``; a tokenizer without a template is an error.
    * Prompts are never truncated (as the reference); prompts longer than ``max_length`` tokens are dropped and
      counted (``stats["train_prompts_too_long"]``), as are empty ones.
    * Every other column (e.g. ``answer``) reaches the reward functions as a keyword argument, one entry per
      completion; ``completion``/``completion_ids`` columns are not passed (as the reference).
    * Prompts with images (an ``images`` column, a list per row, or ``image``; PIL images, paths or bytes) need a
      vision-language model's processor as tokenizer (``tokenizer="tiny-vl"`` or a saved one). Conversational
      prompts get their images as TRL 1.16 places them (``{"type": "image"}`` parts filled in order; string contents
      get one placeholder per image before the first user turn); string prompts hold the processor's image token
      (``<image>``) once per image, which TRL does not accept. Rows are checked at setup without decoding an image
      and kept undecoded; each batch is processed with the processor (placeholders expanded to the image tokens,
      pixel values), its image inputs kept per row (:mod:`lit_trainer.data.vision.prompt`), and the reward functions get
      the decoded images under the column's name (``images``: a list of PIL images per completion). ``max_length``
      counts the image tokens.

    ``batch_size`` is the reference's ``per_device_train_batch_size``: completions per micro-batch per rank. Only
    ``sampling="random"`` (the reference's shuffled ``RepeatSampler``, seeded with ``seed``, epoch ``e`` drawing the
    ``e+1``-th permutation) and ``"sequential"`` (``shuffle_dataset=False``) apply to prompts.

    Args:
        prompt_column: name of the prompt column.
        **kwargs: the options of :class:`~lit_trainer.data.base.BaseDataModule` (``tokenizer``, ``dataset``,
            ``max_length`` (longest prompt kept), ``batch_size``, ``eval_batch_size``, ``sampling``, ``seed``, ...).

    Raises:
        ValueError: for a ``sampling`` other than random/sequential; at setup, for a missing prompt column, a
            conversational dataset with a tokenizer without chat template, or no prompt within ``max_length``; for
            images given to a text-only tokenizer, an image that cannot be read or placeholders that do not match a
            row's images (the row named).

    Example::

        dm = PromptDataModule(tokenizer="tiny", dataset="builtin:addition", batch_size=64, max_length=16)
        trainer.fit(GRPOModule("tiny", reward_funcs=["lit_trainer.rewards.arithmetic_reward"]), datamodule=dm)
    """

    builtin: ClassVar[BuiltinSources] = {
        "builtin:addition": builtin.prompt_rows,
        "builtin:tool_addition": builtin.tool_addition_prompt_rows,
        "builtin:tool_multiplication": builtin.tool_multiplication_prompt_rows,
        "builtin:shapes": builtin_shapes.prompt_rows,
    }
    task_rows: ClassVar[TaskRows | None] = "prompt"

    def __init__(self, *args: Any, prompt_column: str = "prompt", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.hparams.sampling not in get_args(PromptSampling):
            raise ValueError(
                f"`sampling={self.hparams.sampling!r}` does not apply to GRPO prompts: use one of "
                f"{get_args(PromptSampling)} ('random' is the reference's shuffled RepeatSampler)."
            )
        self.save_hyperparameters(ignore=["tokenizer", "dataset", "validation_dataset"])
        self.conversational = False
        self.image_column: str | None = None  # the image column of prompts with images (processed per batch)

    # ------------------------------------------------------------------------------------------- preprocessing
    def _prompt_ids(self, prompts: list[Any]) -> list[list[int]]:
        return prompt_token_ids(
            self.tokenizer, prompts, conversational=self.conversational, drop_eos=self._appends_eos()
        )

    def _appends_eos(self) -> bool:
        """Whether the tokenizer ends every encoding with an EOS it adds itself (ByT5 does)."""
        return appends_eos(self.tokenizer)

    @override
    def _check_rows(self, rows: Dataset, split: str, where: Locator) -> None:
        column = self.hparams.prompt_column
        if column not in rows.column_names:  # _check_format names the missing column
            return
        if (images := vision.image_column(rows.column_names)) is not None:
            return self._check_image_rows(rows, images, where, split)
        check_cells(rows, [column], where, _prompt_problem, "prompt row")

    def _check_image_rows(self, rows: Dataset, images: str, where: Locator, split: str) -> None:
        """Prompts with images, checked without decoding: a text-only tokenizer refused, then each row's images
        (readable), conversation and placeholders (``{"type": "image"}`` parts, or the image token in a string
        prompt) named when wrong."""
        column, what = self.hparams.prompt_column, f"The {split} prompt data"
        rows = vision_rows.undecoded(rows, images)
        if self.processor is None:
            vision_rows.refuse_text_model(rows, images, where, what)
        check_cells(rows, [column], where, missing_or_not_text_or_conversation, "prompt row")
        chat = len(rows) > 0 and is_conversation(rows[0][column])
        vision_rows.check_image_rows(
            rows, images, where, conversations=(column,) if chat else (), texts=() if chat else (column,),
            image_token=getattr(self.processor, "image_token", "<image>"),
        )  # fmt: skip

    def _check_format(self, rows: Dataset, split: str) -> None:
        column = self.hparams.prompt_column
        if column not in rows.column_names:
            raise ValueError(
                f"The {split} data has no {column!r} column (it has {describe_columns(rows)}). Rename "
                "your prompt column or set `prompt_column`."
            )
        self._require_rows(rows, split)
        self.conversational = is_conversation(rows[0][column])
        if self.conversational:
            require_chat_template(self.tokenizer, f"The {split} prompt data")

    @override
    def _preprocess(self, rows: Dataset, split: str) -> Dataset:
        self._check_format(rows, split)
        column, limit = self.hparams.prompt_column, self.hparams.max_length
        if (images := vision.image_column(rows.column_names)) is not None:
            self.image_column = images
            rows = vision_rows.undecoded(rows, images)
            data = vision_rows.keep_rows(rows, self._image_prompt_length(images), split, self.locators.get(split))
        else:
            options = {"column": column, "conversational": self.conversational, "drop_eos": self._appends_eos()}
            data = rows.map(
                tokenize_prompts,
                batched=True,
                fn_kwargs={"tokenizer": self.tokenizer, **options},
                desc=f"Tokenizing {split} prompts",
            )
        lengths = data["length"]
        self.stats[f"{split}_prompts_too_long"] = sum(n > limit for n in lengths)
        self.stats[f"{split}_prompts_empty"] = sum(n == 0 for n in lengths)
        if any(n > limit or n == 0 for n in lengths):
            rank_zero_warn(
                f"[lit_trainer] {split}: dropped {self.stats[f'{split}_prompts_too_long']} prompts longer "
                f"than max_length={limit} tokens (prompts are never truncated) and "
                f"{self.stats[f'{split}_prompts_empty']} empty prompts."
            )
            data = data.filter(lambda b: [0 < n <= limit for n in b["length"]], batched=True)
        if len(data) == 0:
            raise ValueError(f"No {split} prompt fits within max_length={limit} tokens: raise max_length.")
        return data

    def _image_prompt_length(self, images: str) -> Any:
        """A prompt's length with images: its text tokens, each image placeholder counted as the tokens it expands to
        (exact for processors with a fixed image size, such as ``tiny-vl``'s)."""
        column = self.hparams.prompt_column
        per_image = vision_rows.image_tokens_per_image(self.processor)
        known: dict[tuple[str, int], int] = {}  # many rows share their text (one question about many pictures)

        def length(row: dict[str, Any]) -> int:
            count = len(vision.row_images(row, images))
            key = (repr(row[column]), count)
            if key not in known:
                prompt = vision.with_images(row[column], [None] * count, "row") if self.conversational else row[column]
                known[key] = len(self._prompt_ids([prompt])[0]) + count * (per_image - 1)
            return known[key]

        return length

    # ----------------------------------------------------------------------------------------------- batches
    @override
    def _collate(self, rows: list[dict[str, Any]], train: bool) -> dict[str, Any]:
        """Left-padded prompt ids and mask (for ``generate``), the raw prompts and the reward columns (lists). With
        images: the prompts processed now by the processor, the image inputs per row
        (:func:`~lit_trainer.data.vision.prompt.pack_row_images`) and the decoded images as the image column's reward
        keyword; conversational prompts reach the reward functions with their images filled in, as TRL 1.16's."""
        column = self.hparams.prompt_column
        internal = {column, "length", ROW_KEY, *_EXCLUDED_COLUMNS}
        extras = [c for c in rows[0] if c not in internal]
        rewards = {c: [row[c] for row in rows] for c in extras}
        image_inputs: dict[str, Any] = {}
        if self.image_column is not None:
            split = "train" if train else "validation"
            encoded = VisionPromptEncoder(
                self.processor, self.image_column, column, self.conversational, split, drop_eos=self._appends_eos(),
                place=functools.partial(self.row_place, split=split),
            )(rows)  # fmt: skip
            ids, prompts = [e.ids for e in encoded], [e.prompt for e in encoded]
            rewards[self.image_column] = reward_images(encoded, self.image_column)
            image_inputs = pack_row_images([e.images for e in encoded])
            for name, key in zip(PROMPT_PER_TOKEN_KEYS, PER_TOKEN_KEYS):
                if any(key in e.per_token for e in encoded):
                    image_inputs[name] = pad_left([e.per_token.get(key, [0] * len(e.ids)) for e in encoded], 0)
        else:
            ids, prompts = [row[PROMPT_IDS] for row in rows], [row[column] for row in rows]
        return {
            PROMPT_IDS: pad_left(ids, self.pad_token_id),
            PROMPT_MASK: pad_left([[1] * len(i) for i in ids], 0),
            PROMPTS: prompts,
            REWARD_COLUMNS: rewards,
            **image_inputs,
        }

    @override
    def count_items(self, batch: dict[str, Any]) -> int:
        """Prompt rows. Not the GRPO normaliser: completion tokens are only known after generation (the module
        computes that count itself)."""
        return len(batch[PROMPTS])

    def generation_loader(
        self,
        geometry: RolloutGeometry,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        accumulate_grad_batches: int = 1,
    ) -> TrainLoader:
        """The training loader for an explicit geometry (what :meth:`train_dataloader` builds).

        Args:
            geometry: num_generations, steps_per_generation, generation_batch_size (over all ranks), num_iterations.
            num_replicas: world size.
            rank: this rank.
            accumulate_grad_batches: micro-batches per optimizer step.

        Returns:
            A resumable :class:`TrainLoader` yielding one local generation batch per micro-step.

        Raises:
            ValueError: (from :class:`RepeatSampler`) when there are fewer prompts than one generation batch needs.
        """
        if self.train_dataset is None:
            self.setup("fit")
        hp = self.hparams
        sampler = RepeatSampler(
            len(self.train_dataset), mini_repeat_count=geometry.num_generations,
            batch_size=geometry.generation_batch_size // geometry.num_generations,
            repeat_count=geometry.num_iterations * geometry.steps_per_generation,
            shuffle=hp.sampling == "random", seed=hp.seed, num_replicas=num_replicas, rank=rank,
        )  # fmt: skip
        batches = GenerationBatchSampler(sampler, geometry.generation_batch_size // num_replicas)
        return TrainLoader(
            self._current("train"),
            batches,
            self._guarded_collate(),
            count_items=None,
            accumulate_grad_batches=accumulate_grad_batches,
            windows=self._step_windows(),
            seed=hp.seed,
            bad_rows=self._bad_rows(),
            **self._loader_options(),
        )

    @override
    def train_dataloader(self) -> TrainLoader:
        module = self.trainer.lightning_module if self.trainer is not None else None
        geometry = getattr(module, "rollout_geometry", None)
        if not isinstance(geometry, tuple) or len(geometry) != 4:
            raise ValueError(
                "PromptDataModule.train_dataloader() needs a LightningModule with a resolved `rollout_geometry` (a "
                "GRPOModule, after setup). Outside a Trainer, call `generation_loader(RolloutGeometry(...))`."
            )
        world, rank, accumulate = self._replicas()
        return self.generation_loader(
            RolloutGeometry(*geometry), num_replicas=world, rank=rank, accumulate_grad_batches=accumulate
        )
