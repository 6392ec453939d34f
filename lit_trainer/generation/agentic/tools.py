"""Tools for GRPO rollouts: resolving them, parsing the tool calls of a completion, running them, and the tokens that
put their results back into the conversation.

A tool is a plain Python function (or a bound method of an environment), sync or ``async def``, with type hints and a
Google docstring, so ``transformers.utils.get_json_schema`` can describe it to the chat template
(``apply_chat_template(tools=...)``); :func:`check_tool_schema` checks that when the module is built.
Tools come only from the user's config or code: a callable, or the import path of one (``"package.module.add"``).

Tool calls are read from the tokens of one assistant turn with the tokenizer's own response parser
(``tokenizer.parse_response``, transformers' response templates) when the tokenizer has one; the presets' tokenizer
has one for the Hermes/Qwen syntax ``<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>``. A
tokenizer without a parser gets the same syntax read by :func:`parse_tool_calls`. A completion that does not parse
(malformed JSON, a call without a name) is plain text: it makes no call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from lit_trainer.core.awaitables import resolve_awaitables
from lit_trainer.core.import_path import import_object

_CALL = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.DOTALL)


def resolve_tools(tools: Sequence[str | Callable[..., Any]] | None) -> list[Callable[..., Any]]:
    """Tool callables from callables or their import paths (only what the user names is imported).

    Raises:
        ValueError: for a path that does not import, an entry that is not callable or cannot be described to the model
            (:func:`check_tool_schema`), or two tools with one name.
    """
    resolved: list[Callable[..., Any]] = []
    for item in tools or []:
        if isinstance(item, str):
            item = import_object(
                item,
                "Tool",
                "give 'package.module.function' of an importable function, e.g. 'lit_trainer.data.builtin.add'.",
            )
        if not callable(item):
            raise ValueError(f"Tool {item!r} is not callable: give a function or its import path.")
        check_tool_schema(item)
        resolved.append(item)
    names = [tool_name(t) for t in resolved]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Two tools are named {duplicates}: tool names must be unique (the model calls them by name).")
    return resolved


def check_tool_schema(tool: Callable[..., Any], where: str = "") -> None:
    """Refuse, when the module is built, a tool whose schema ``transformers.utils.get_json_schema`` cannot write (what
    ``apply_chat_template(tools=...)`` does at the first generation, after model and data setup).

    Args:
        tool: the function or bound method.
        where: appended to its name in the message, e.g. ``" (a method of environment AddEnv ...)"``.

    Raises:
        ValueError: naming the function and transformers' reason (no docstring, an argument without a type hint or
            without a line in ``Args:``).
    """
    try:
        get_json_schema(tool)
    except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException, or any other
        name = getattr(tool, "__qualname__", tool_name(tool))
        raise ValueError(
            f"Tool {name!r}{where} cannot be described to the model ({err}): a tool needs a type hint on every "
            "argument and a Google-style docstring, a description then `Args:` with one line per argument "
            "(transformers.utils.get_json_schema writes the schema the chat template shows from them)."
        ) from None


def tool_name(tool: Callable[..., Any]) -> str:
    """The name the model calls a tool by (the function's ``__name__``)."""
    return getattr(tool, "__name__", type(tool).__name__)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of one assistant turn in the ``<tool_call>{json}</tool_call>`` syntax.

    ``content`` is the text before the first call; each call is ``{"type": "function", "function": {"name",
    "arguments"}}`` (the shape ``apply_chat_template`` renders). A call whose JSON does not parse or has no string
    ``name`` makes the whole turn plain text (no calls), as a malformed call is in the reference.

    Example: ``'<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'`` ->
    ``("", [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}])``.
    """
    calls = []
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return text, []
        arguments = {} if body.get("arguments") is None else body["arguments"]  # as the response templates read it
        calls.append({"type": "function", "function": {"name": body["name"], "arguments": arguments}})
    content = text.split("<tool_call>", 1)[0] if calls else text
    return content, calls


def parse_assistant_turn(
    tokenizer: Any, ids: list[int], prefix: list[int], tools: Sequence[Callable[..., Any]]
) -> dict[str, Any]:
    """One generated assistant turn as a message ``{"role": "assistant", "content", "tool_calls"?}``.

    Uses ``tokenizer.parse_response(ids, prefix=prefix, tools=tools)`` when the tokenizer has a response template
    (``response_template``), else :func:`parse_tool_calls` on the decoded text. A turn that does not parse is plain
    text (decoded without special tokens).
    """
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            parsed = tokenizer.parse_response(ids, prefix=prefix, tools=list(tools))
        except (ValueError, TypeError):
            parsed = None
        if isinstance(parsed, dict) and _valid_calls(parsed.get("tool_calls")):
            message = {"role": "assistant", "content": parsed.get("content") or ""}
            if parsed.get("tool_calls"):
                message["tool_calls"] = parsed["tool_calls"]
            return message
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    content, calls = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def _valid_calls(calls: Any) -> bool:
    if calls is None:
        return True
    if not isinstance(calls, list):
        return False
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return False
        if function.get("arguments") is None:
            function["arguments"] = {}
    return True


@dataclass
class ToolStats:
    """Tool calls made and failed in one generation round (this rank)."""

    calls: int = 0
    failures: int = 0
    per_row: list[int] = field(default_factory=list)


def run_tool_turns(
    turns: Sequence[tuple[Sequence[dict[str, Any]], dict[str, Callable[..., Any]]]],
    stats: ToolStats,
    rows: Sequence[int],
) -> list[list[dict[str, Any]]]:
    """Run the calls of several rows' turns -> per turn, one ``{"role": "tool", "name", "content"}`` message per call,
    in call order.

    ``turns`` holds, per row, the turn's calls and the tools that row may call; ``rows`` are the rows' indices in
    ``stats.per_row``. Plain tools run at once, in row and call order; the awaitables that ``async def`` tools return
    are then awaited all together, across rows, on the background event loop
    (:func:`lit_trainer.core.awaitables.resolve_awaitables`), so a round's slow tools (a web request, a sandbox)
    overlap. A tool that raises (when called or while awaited), an unknown tool name, arguments that are not a JSON
    object, or a call of another type is reported to the model as ``{"error": "<message>"}``, with TRL 1.16's
    messages, and counted in ``stats.failures``; it never stops the run.
    """
    started = [[_start(call, tools, stats, row) for call in calls] for (calls, tools), row in zip(turns, rows)]
    values = iter(resolve_awaitables([value for results in started for _, value in results]))
    messages = []
    for results in started:
        messages.append([])
        for name, value in zip((name for name, _ in results), values):
            if isinstance(value, BaseException):  # an async tool raised while awaited
                stats.failures += 1
                value = {"error": str(value)}
            messages[-1].append({"role": "tool", "name": name, "content": str(value)})
    return messages


def _start(call: dict[str, Any], tools: dict[str, Callable[..., Any]], stats: ToolStats, row: int) -> tuple[str, Any]:
    """Count and make one call: ``(name, result)``; the result is an awaitable for an async tool, an error dict when
    the call fails."""
    stats.calls += 1
    stats.per_row[row] += 1
    # The error texts are TRL 1.16's, word for word (the model reads them: other tokens, another loss): an unknown
    # name is "Tool <name> not found.", arguments that are not an object are Python's own TypeError of `f(**args)`.
    if call.get("type", "function") != "function":
        stats.failures += 1
        return str(call.get("name", "unknown")), {"error": f"Unsupported tool call type: {call.get('type')}"}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    name = function.get("name", "unknown")
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        return name, tools[name](**function.get("arguments", {}))
    except Exception as err:  # a tool's error is the model's observation, never a crash
        stats.failures += 1
        return name, {"error": str(err)}


def tool_suffix_ids(
    tokenizer: Any, tool_messages: Sequence[dict[str, Any]], chat_template_kwargs: dict | None = None
) -> list[int]:
    """The tokens the chat template puts after an assistant turn that made calls: the tool messages and the next
    assistant header.

    Rendered by difference on a small conversation (a user turn and an assistant turn calling the first tool, with
    and without the tool messages), cut after the last EOS of the shorter rendering; so it needs a chat template
    that renders a conversation's prefix identically whatever follows.

    Raises:
        ValueError: when the template is not prefix-preserving (the shorter rendering is not a prefix of the longer).
    """
    call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": call}]
    options = {"tokenize": True, "return_dict": False, **(chat_template_kwargs or {})}
    before = list(tokenizer.apply_chat_template(head, add_generation_prompt=False, **options))
    after = list(tokenizer.apply_chat_template(head + list(tool_messages), add_generation_prompt=True, **options))
    eos = getattr(tokenizer, "eos_token_id", None)
    ends = [i for i, t in enumerate(before) if t == eos]
    if ends:
        before = before[: ends[-1] + 1]
    if after[: len(before)] != before:
        raise ValueError(
            "The chat template does not render an assistant turn with tool calls the same way when tool messages "
            "follow, so tool results cannot be appended to generated tokens: use a prefix-preserving chat template."
        )
    return after[len(before) :]
