"""Conversations with images: TRL's placeholder rules, checked per row.

A user turn holds an image as a ``{"type": "image"}`` part of a list content. Rows whose turns are plain strings get
one placeholder per image at the start of the first user turn (TRL's ``prepare_multimodal_messages``). Either way the
placeholders must match the row's images one for one; a row with more placeholders than images, or fewer, is refused
with the row named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [dict(part) for part in content]


def count_placeholders(messages: Sequence[Mapping[str, Any]]) -> int:
    """Image parts (``{"type": "image"}``) in the list contents of ``messages``."""
    return sum(
        1
        for message in messages
        if not isinstance(message.get("content"), str)
        for part in message.get("content") or []
        if isinstance(part, Mapping) and part.get("type") == "image"
    )


def is_structured(messages: Sequence[Mapping[str, Any]]) -> bool:
    """True when some message's content is a list of parts (the row places its images itself)."""
    return any(isinstance(m.get("content"), Sequence) and not isinstance(m.get("content"), str) for m in messages)


def placeholder_problem(messages: Sequence[Mapping[str, Any]], num_images: int) -> str | None:
    """Why the images of a conversation cannot be placed (None when they can)."""
    if not is_structured(messages):
        if num_images and not any(m.get("role") == "user" for m in messages):
            return f"{num_images} image(s) but no user turn to hold them"
        return None
    found = count_placeholders(messages)
    if found != num_images:
        more = "more" if found > num_images else "fewer"
        return (
            f"{found} image placeholder(s) for {num_images} image(s) ({more} placeholders than images): give one "
            "{'type': 'image'} part per image of the row"
        )
    return None


def with_images(messages: Sequence[Mapping[str, Any]], images: Sequence[Any], where: str) -> list[dict[str, Any]]:
    """``messages`` in structured form with ``images`` filled into their placeholders, in order.

    String contents become ``[{"type": "text", "text": ...}]``; unstructured rows get their placeholders first in the
    first user turn.

    Raises:
        ValueError: the placeholders do not match the images (:func:`placeholder_problem`), naming ``where``.
    """
    problem = placeholder_problem(messages, len(images))
    if problem is not None:
        raise ValueError(f"{where}: {problem}.")
    structured = is_structured(messages)
    out, pending, placed = [], list(images), False
    for message in messages:
        message = dict(message)
        parts = _parts(message.get("content"))
        if not structured and not placed and message.get("role") == "user":
            parts = [{"type": "image"} for _ in pending] + parts
            placed = True
        for part in parts:
            if part.get("type") == "image":
                part["image"] = pending.pop(0)
        message["content"] = parts
        out.append(message)
    return out
