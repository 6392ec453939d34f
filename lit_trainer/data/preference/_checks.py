"""Validation of raw preference rows: every cell's type and emptiness, and one format (text or messages) per row."""

from __future__ import annotations

import math
from typing import Any


class RowProblem(Exception):
    """A malformed cell, raised by the row checks and reported with the row's location."""

    def __init__(self, column: str, problem: str) -> None:
        super().__init__(column, problem)
        self.column, self.problem = column, problem


def _check_value(value: Any, column: str, allow_empty: bool) -> bool:
    """Validate one cell; return True when it is a conversation (a list of messages).

    Raises:
        RowProblem: naming the column and what is wrong.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise RowProblem(column, "the value is missing (an empty cell or null)")
    if isinstance(value, str):
        if not value and not allow_empty:
            raise RowProblem(column, "the value is empty")
        return False
    if not isinstance(value, list):
        raise RowProblem(column, f"expected a string or a list of messages, got {type(value).__name__}")
    if not value and not allow_empty:
        raise RowProblem(column, "the message list is empty")
    for m, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowProblem(column, f"message {m} is not a {{'role': str, 'content': str}} dict")
        if not isinstance(message.get("content"), str):
            raise RowProblem(column, f"message {m} has non-string content ({type(message.get('content')).__name__})")
    return True


def check_row(row: dict[str, Any]) -> None:
    """Validate a row's prompt (optional, may be empty), chosen and rejected cells, and that they share one format.

    Raises:
        RowProblem: naming the column and what is wrong.
    """
    formats = {column: _check_value(row[column], column, allow_empty=False) for column in ("chosen", "rejected")}
    if "prompt" in row:
        formats["prompt"] = _check_value(row["prompt"], "prompt", allow_empty=True)
    odd = next((column for column, is_chat in formats.items() if is_chat != formats["chosen"]), None)
    if odd is not None:
        raise RowProblem(odd, "mixes plain strings and message lists within one row")


def value_problem(value: Any, column: str) -> str | None:
    """What is wrong with one cell of ``column`` (None when it is valid); the prompt may be empty."""
    try:
        _check_value(value, column, allow_empty=column == "prompt")
    except RowProblem as bad:
        return bad.problem
    return None
