"""Conversations (lists of ``{"role", "content"}`` messages): checking, rendering and finding the assistant tokens.

One rendering path for every data module (SFT, preference, prompt): :func:`render` applies the tokenizer's chat
template and returns token ids; :func:`template_options` reads a row's optional ``tools`` (a list, or a JSON string)
and ``chat_template_kwargs`` (a dict of extra template variables) columns.

:func:`assistant_tokens` renders a conversation and says which of its tokens the assistant wrote (1) and which it
did not (0), for ``assistant_only_loss``. It uses the template's ``{% generation %}`` markers when it has them (the
tokenizer's ``return_assistant_tokens_mask``); otherwise it renders the conversation turn by turn and requires each
partial render to be a prefix of the next (the assistant's tokens of turn ``i`` are those between
``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i + 1])``). A template for which
neither works (no markers, and a turn that re-renders earlier text, such as one that drops past reasoning) is refused
with an error rather than guessed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lit_trainer.data.collate import common_prefix_len

ROLES = ("system", "developer", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def is_conversation(value: Any) -> bool:
    """True for a list of message dicts (a conversation), False for a string or anything else."""
    return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(m, Mapping) for m in value)


def conversation_problem(value: Any) -> str | None:
    """What is wrong with a cell that should hold a conversation (None when it is a valid one).

    A conversation is a non-empty list of messages, each with a ``role`` in :data:`ROLES` and a non-empty string
    ``content`` (an assistant message that carries ``tool_calls`` may have an empty content).
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "the value is missing (an empty cell or null)"
    if isinstance(value, str) or not isinstance(value, Sequence):
        return f"expected a list of {{'role', 'content'}} messages, got {type(value).__name__} {value!r:.60}"
    if not value:
        return "the message list is empty"
    for m, message in enumerate(value):
        if not isinstance(message, Mapping):
            return f"message {m} is a {type(message).__name__}, not a {{'role', 'content'}} dict"
        role, content = message.get("role"), message.get("content")
        if role is None:
            return f"message {m} has no 'role'"
        if role not in ROLES:
            return f"message {m} has an unknown role {role!r} (use one of {ROLES})"
        if content is not None and not isinstance(content, str):
            return f"message {m} has non-string content ({type(content).__name__})"
        if not content and not message.get("tool_calls"):
            return f"message {m} ({role}) has empty content"
    return None


def require_chat_template(tokenizer: Any, what: str) -> None:
    """Raise when ``tokenizer`` has no chat template (``what`` names the data, e.g. "The SFT training data").

    Raises:
        ValueError: naming the fix.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{what} holds conversations (lists of messages) but the tokenizer has no chat template: "
            "set `tokenizer.chat_template`, or give plain-string rows."
        )


def template_options(row: Mapping[str, Any]) -> dict[str, Any]:
    """``tools`` (decoded when a JSON string) and the entries of ``chat_template_kwargs`` of one row.

    Entries of ``chat_template_kwargs`` that are None are left out (``datasets`` fills keys that other rows have with
    None), so a template's ``is defined`` tests see only what the row set.
    """
    tools = row.get("tools")
    options = {key: value for key, value in (row.get("chat_template_kwargs") or {}).items() if value is not None}
    if tools is not None:
        options["tools"] = json.loads(tools) if isinstance(tools, str) else tools
    return options


def render(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **options: Any
) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template (``options``: tools, template
    variables)."""
    out = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True, **options
    )
    return list(out["input_ids"])


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks the assistant's text with ``{% generation %}`` blocks."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and _GENERATION_TAG.search(template) is not None


def _tokens_from_markers(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], options: dict[str, Any]
) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **options
    )
    mask = [int(bool(m)) for m in out["assistant_masks"]]
    if any(m.get("role") == "assistant" for m in messages) and not any(mask):
        raise ValueError(
            "The chat template has {% generation %} markers but they enclose no token of this "
            "conversation's assistant turns: put them around the assistant content."
        )
    return list(out["input_ids"]), mask


def _tokens_from_prefixes(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], options: dict[str, Any]
) -> tuple[list[int], list[int]]:
    ids = render(tokenizer, messages, **options)
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:turn], add_generation_prompt=True, **options) if turn else []
        after = render(tokenizer, messages[: turn + 1], **options)
        if common_prefix_len(before, after) < len(before) or common_prefix_len(after, ids) < len(after):
            raise ValueError(
                "`assistant_only_loss=True` cannot find the assistant tokens with this chat template: it has no "
                "{% generation %} markers, and rendering the conversation turn by turn does not give prefixes of "
                f"the whole conversation (turn {turn} differs). Wrap the assistant content of the template in "
                "{% generation %}...{% endgeneration %}, or set `assistant_only_loss=False`."
            )
        mask[len(before) : len(after)] = [1] * (len(after) - len(before))
    return ids, mask


def assistant_tokens(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], options: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """``(ids, mask)``: the rendered conversation (as :func:`render`) and a 1/0 mask of the assistant's tokens.

    Raises:
        ValueError: when the template has no generation markers and fails the turn-by-turn prefix check, or when its
            markers enclose nothing.
    """
    finder = _tokens_from_markers if has_generation_markers(tokenizer) else _tokens_from_prefixes
    return finder(tokenizer, messages, options)
