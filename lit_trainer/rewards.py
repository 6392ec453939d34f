"""Built-in GRPO reward functions and the safe caller that turns their outputs into a reward matrix.

A reward function is any callable ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``: one
value per completion, ``None`` = "this function does not score this row" (it becomes NaN, see
``lit_trainer.losses.grpo_advantages.grpo_advantages``). ``columns`` are the other dataset columns, one list entry per
row. It may be ``async def`` (an LLM judge, a remote checker): the async functions of a round are awaited together.

Example:
    >>> arithmetic_reward(["37+45="] * 2, ["82", " 81"], [[], []], answer=[82, 82])
    [1.0, 0.0]
    >>> call_reward_functions([arithmetic_reward, format_reward], ["1+1="], ["2"], [[]], {"answer": ["2"]})
    tensor([[1., 1.]])
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch

from lit_trainer.core.awaitables import resolve_awaitables
from lit_trainer.data import reasoning_gym

RewardFunc = Callable[..., Sequence[float | None]]
"""``f(prompts, completions, completion_ids, **columns) -> list[float | None]``."""
RewardModelInputs = Literal["as_trained", "trl"]
"""How a reward model's standard-format text is built (:class:`RewardModelScorer`): ``"as_trained"`` = prompt +
completion + EOS with the tokenizer's special tokens, as reward models are trained; ``"trl"`` = TRL 1.16's GRPO text,
prompt + completion without EOS or special tokens."""

_RESERVED = ("prompts", "completions", "completion_ids")
_INTEGER = re.compile(r"[+-]?\d+")


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something other than one number (or None) per completion."""


def completion_text(completion: Any) -> str:
    """The text of a completion: a string as is, or the ``content`` of the last assistant message of a conversational
    one (a multi-turn completion with tool messages is judged by its final answer; "" when it ends on a tool result).

    Args:
        completion: ``"82"`` or ``[{"role": "assistant", "content": "82"}]``.

    Returns:
        The completion text.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        last = completion[-1]
        return str(last.get("content", "") or "") if last.get("role", "assistant") == "assistant" else ""
    return str(completion)


def arithmetic_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    answer: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float | None]:
    """Correctness reward of the built-in arithmetic task: 1.0 if the stripped completion equals the answer, else 0.0.

    Args:
        prompts: e.g. ``"37+45="`` (unused).
        completions: decoded completions, e.g. ``"82"``.
        completion_ids: token ids (unused).
        answer: the dataset's ``answer`` column (int or str per row).
        **columns: other dataset columns (ignored).

    Returns:
        One float per completion.

    Raises:
        ValueError: if the dataset has no ``answer`` column.
    """
    if answer is None:
        raise ValueError("`arithmetic_reward` needs an `answer` column in the dataset (the correct result per prompt).")
    return [1.0 if completion_text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def reasoning_gym_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    rg_entry: Sequence[str | None] | None = None,
    **columns: Any,
) -> list[float | None]:
    """The verifier of a ``reasoning_gym:<task>`` problem (:mod:`lit_trainer.data.reasoning_gym`): the task's own
    score, 0 to 1, of the stripped completion text; ``None`` for a row without a problem (another task's row).

    Args:
        prompts: the prompts (unused).
        completions: decoded completions (text or conversational).
        completion_ids: token ids (unused).
        rg_entry: the dataset's ``rg_entry`` column: the problem as JSON.
        **columns: other dataset columns (ignored).

    Raises:
        ValueError: the rows have no ``rg_entry`` column (the data is not a ``reasoning_gym:`` source).
    """
    if rg_entry is None:
        raise ValueError(
            "reasoning_gym_reward needs the `rg_entry` column, which `reasoning_gym:<task>` data sources write: "
            "use such a source (dataset: reasoning_gym:chain_sum) or another reward function."
        )
    return [
        None if entry is None else reasoning_gym.score_answer(completion_text(c).strip(), entry)
        for c, entry in zip(completions, rg_entry)
    ]


def format_reward(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]], **columns: Any
) -> list[float | None]:
    """Format reward: 1.0 if the stripped completion is a plain integer (optional sign, digits only), else 0.0.

    Args:
        prompts: unused.
        completions: decoded completions.
        completion_ids: unused.
        **columns: dataset columns (ignored).

    Returns:
        One float per completion.
    """
    return [1.0 if _INTEGER.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


def is_conversational(prompts: Sequence[Any]) -> bool:
    """Whether a batch's prompts are conversations (lists of messages) rather than strings."""
    return bool(prompts) and not isinstance(prompts[0], str)


def reward_model_name(path: str) -> str:
    """A reward model's display name: the last part of its path (TRL's rule), except for a ``lit-trainer`` export
    ``.../<run name>/version_<n>/hf_model``, which is named after its run (``runs/reward/version_0/hf_model`` ->
    ``reward``)."""
    parts = [p for p in path.replace(os.sep, "/").split("/") if p]
    if len(parts) >= 3 and parts[-1] == "hf_model" and parts[-2].startswith("version_"):
        return parts[-3]
    return parts[-1] if parts else ""


class RewardModelScorer:
    """A sequence-classification reward model used as a GRPO reward function (TRL 1.16's ``reward_funcs`` model entry).

    Called like any reward function, it scores ``prompt + completion``, tokenized as the reward model was trained
    (``inputs="as_trained"``, the default):

    * standard data (strings): ``prompt + completion + EOS`` (the reward tokenizer's EOS string, appended unless the
      completion ends with it), tokenized with the tokenizer's default special tokens (a BOS where it adds one): the
      rows :class:`~lit_trainer.modules.reward.RewardModule` and TRL's ``RewardTrainer`` train on.
      ``inputs="trl"`` scores TRL 1.16's ``GRPOTrainer`` text instead: ``prompt + completion``, no EOS, no special
      tokens, which a reward model trained on EOS-ended rows has never seen (docs/reward.md measures the difference);
    * conversational data: the prompt messages followed by the completion's assistant message, rendered with the
      reward tokenizer's chat template (no generation prompt, with ``chat_template_kwargs``), tokenized without
      special tokens (the template writes them). This is the same in both modes and equals the training rows, since
      the template ends the assistant turn itself.

    The rows are padded on the right and the reward is ``logits[:, 0]`` of the frozen model in eval mode under
    ``torch.no_grad`` (the score of each row's last non-padding token), as ``trl.GRPOTrainer`` computes it.

    Args:
        model: a ``PreTrainedModel`` for sequence classification, or a preset name / local directory / hub id loaded
            with :func:`lit_trainer.models.load_model` (``task="sequence_classification"``, one label; a causal-LM
            export gets a new, untrained score head).
        tokenizer: the reward model's tokenizer (object, or a name/path to load); default: the one of ``model``'s
            name or path (``config._name_or_path`` for an object). Its padding id becomes the model's, so the score is
            read at the last real token; a tokenizer without padding token pads with EOS, as TRL.
        batch_size: rows per forward pass (None = all rows of a call in one pass, as TRL).
        trust_remote_code: passed to the loaders; False unless you set it.
        inputs: ``"as_trained"`` or ``"trl"`` (above).
        chat_template_kwargs: extra ``apply_chat_template`` keywords for conversational texts (TRL 1.16 passes its
            ``GRPOConfig.chat_template_kwargs``).

    The model is not a submodule of the LightningModule using it: it is frozen, left out of checkpoints (a resumed run
    loads it again from its path) and moved to the policy's device by :class:`~lit_trainer.modules.grpo.GRPOModule`
    before each scoring (:meth:`to`).

    Raises:
        ValueError: if ``model`` is not a sequence classifier with one output, its tokenizer cannot be found, or
            ``inputs`` is not one of :data:`RewardModelInputs`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        batch_size: int | None = None,
        trust_remote_code: bool = False,
        inputs: RewardModelInputs = "as_trained",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from lit_trainer.models import load_model, load_tokenizer

        if inputs not in get_args(RewardModelInputs):
            raise ValueError(
                f"Reward model `inputs={inputs!r}` is invalid: choose one of {get_args(RewardModelInputs)} "
                "('as_trained': prompt + completion + EOS, as a reward model is trained; 'trl': TRL 1.16's GRPO text)."
            )
        source = ""
        if isinstance(model, (str, os.PathLike)):
            source = str(model)
            model = load_model(source, task="sequence_classification", trust_remote_code=trust_remote_code)
        if not isinstance(model, torch.nn.Module) or getattr(getattr(model, "config", None), "num_labels", None) != 1:
            raise ValueError(
                f"Reward model {type(model).__name__} is not a sequence classifier with one label: give a path or a "
                "`PreTrainedModel` loaded with `AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)`."
            )
        source = source or getattr(model.config, "_name_or_path", "") or ""
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            path = str(tokenizer) if tokenizer is not None else source
            if not path:
                raise ValueError(
                    "The reward model has no `config._name_or_path` to load its tokenizer from: pass its tokenizer "
                    "(`reward_processing_classes` in GRPOModule)."
                )
            tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"`batch_size={batch_size}` is invalid: use >= 1, or None for one pass per call.")
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.inputs = inputs
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = reward_model_name(source) or type(model).__name__

    def to(self, device: torch.device | str) -> RewardModelScorer:
        """Move the model to ``device`` (a no-op when it is there); returns self."""
        self.model.to(device)
        return self

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The texts the model scores: ``prompt + completion`` (+ EOS for standard data with ``inputs="as_trained"``),
        through the chat template for conversations."""
        if is_conversational(prompts):
            return [
                self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **self.chat_template_kwargs)
                for p, c in zip(prompts, completions, strict=True)
            ]
        if self.inputs == "as_trained":
            from lit_trainer.data.preference import end_with_eos

            eos = self.tokenizer.eos_token
            return [p + end_with_eos(c, eos) for p, c in zip(prompts, completions, strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        # standard text as trained: the tokenizer's own special tokens (a BOS), as the training rows have them
        special = self.inputs == "as_trained" and not is_conversational(prompts)
        device = next(self.model.parameters()).device
        size = self.batch_size or max(len(texts), 1)
        scores: list[float] = []
        for start in range(0, len(texts), size):
            inputs = self.tokenizer(
                text=texts[start : start + size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=special,
            ).to(device)
            scores.extend(self.model(**inputs).logits[:, 0].float().tolist())
        return scores


def reward_function_name(func: Callable[..., Any]) -> str:
    """Display name of a reward function: its ``__name__``, the wrapped function's for a partial, else its class."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def _to_float(value: Any, name: str, row: int) -> float:
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(
            f"Reward function `{name}` returned {value!r} for row {row}: each value must be a number or None."
        ) from err


def _accepted(func: RewardFunc, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` keywords ``func`` can take: all of them with ``**kwargs`` (or no readable signature), else the
    ones it names, so a function written before these keywords existed keeps working."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return dict(extra)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(extra)
    names = {p.name for p in parameters}
    return {key: value for key, value in extra.items() if key in names}


def _call(func: RewardFunc, kwargs: dict[str, Any]) -> Any:
    """``func(**kwargs)``: its values, or the awaitable an async function returned (awaited with the others)."""
    try:
        return func(**kwargs)
    except Exception as err:
        raise RewardFunctionError(
            f"Reward function `{reward_function_name(func)}` raised {type(err).__name__}: {err}"
        ) from err


def _check(func: RewardFunc, n: int, values: Any) -> list[float]:
    """One function's values as ``n`` floats (None -> NaN), or a :class:`RewardFunctionError` naming it."""
    name = reward_function_name(func)
    if isinstance(values, BaseException):  # an async function raised while awaited
        raise RewardFunctionError(f"Reward function `{name}` raised {type(values).__name__}: {values}") from values
    try:
        length = len(values)
    except TypeError as err:
        raise RewardFunctionError(
            f"Reward function `{name}` returned {type(values).__name__}, not a list with one value per completion."
        ) from err
    if length != n:
        raise RewardFunctionError(
            f"Reward function `{name}` returned {length} values for {n} completions: return one value (or None) "
            "per completion."
        )
    return [_to_float(v, name, i) for i, v in enumerate(values)]


def call_reward_functions(
    funcs: Sequence[RewardFunc],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]] | None = None,
    *,
    extra_kwargs: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Call every reward function on the same rows and stack the results into a ``(N, F)`` float32 matrix.

    Args:
        funcs: the ``F`` reward functions, called as ``f(prompts=..., completions=..., completion_ids=...,
            **columns, **extra_kwargs)``; an ``async def`` function (or one returning an awaitable) is awaited, all
            of them together, on a background event loop (:mod:`lit_trainer.core.awaitables`), as TRL 1.16 runs them.
        prompts: ``N`` prompts (the prompt repeated for each of its completions).
        completions: ``N`` decoded completions.
        completion_ids: ``N`` lists of completion token ids.
        columns: other dataset columns, each a list of ``N`` values.
        extra_kwargs: more keyword arguments (``GRPOModule`` passes TRL's ``trainer_state``, ``log_metric`` and
            ``log_extra``, see :mod:`lit_trainer.modules.online_rl._reward_calls`), given to a function that takes
            ``**kwargs`` or names them (so an older function without them keeps working).

    Returns:
        ``(N, F)`` float32 CPU tensor; ``None`` returns are NaN.

    Raises:
        ValueError: if ``funcs`` is empty, lengths disagree, or a column is named like a reserved argument.
        RewardFunctionError: naming the function, if it raises (original exception chained) or does not return one
            number or None per completion.
    """
    n = len(completions)
    if not funcs:
        raise ValueError("`funcs` is empty: give at least one reward function.")
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(
            f"{len(prompts)} prompts, {n} completions and {len(completion_ids)} completion_ids: all must match."
        )
    kwargs: dict[str, Any] = {"prompts": list(prompts), "completions": list(completions)}
    kwargs["completion_ids"] = list(completion_ids)
    for key, values in (columns or {}).items():
        if key in _RESERVED or key in (extra_kwargs or {}):
            raise ValueError(f"Dataset column `{key}` clashes with a reward-function argument: rename the column.")
        if len(values) != n:
            raise ValueError(f"Column `{key}` has {len(values)} values for {n} completions: repeat it per completion.")
        kwargs[key] = list(values)
    outputs = resolve_awaitables([_call(func, {**kwargs, **_accepted(func, extra_kwargs or {})}) for func in funcs])
    table = [_check(func, n, values) for func, values in zip(funcs, outputs)]
    return torch.tensor(table, dtype=torch.float32).reshape(len(funcs), n).T.contiguous()
