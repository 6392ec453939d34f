"""Read local data files, and say where a row came from: file and line (1-based, as an editor shows it).

A file that cannot be read raises ONE ``ValueError`` naming the file, the line and the problem (an empty file, a line
that is not valid JSON, a CSV parser error), instead of the parser's chained tracebacks. CSV cells are read as text:
``"010"`` stays ``"010"``, ``"NA"`` stays ``"NA"``, and only an empty cell is a missing value (which the data modules
then report with its line and column).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, Value, load_dataset

_EMPTY_CHECK_BYTES = 1 << 16  # a larger file is not checked for being all whitespace
_JSON_LOADER_LOGGER = "datasets.packaged_modules.json.json"  # logs a 0-based "row" before raising: we say it better


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_not_empty(path: Path) -> None:
    size = path.stat().st_size
    if size == 0 or (size <= _EMPTY_CHECK_BYTES and not path.read_bytes().strip()):
        raise ValueError(f"{path} is empty: it has no rows. Add rows or remove the file.")


def _csv_header(path: Path) -> list[str]:
    with path.open(newline="", encoding="utf-8") as stream:
        return next((row for row in csv.reader(stream) if row), [])


def _read_options(path: Path, builder: str) -> dict[str, Any]:
    """CSV: every column as text, only empty cells missing (pandas would turn "2" into 2 and "NA" into NaN)."""
    if builder != "csv":
        return {}
    features = Features({name: Value("string") for name in _csv_header(path)})
    return {"features": features, "keep_default_na": False, "na_values": [""]}


def _root_message(error: BaseException) -> str:
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    return f"{type(error).__name__}: {error}"


def _is_json_lines(lines: Sequence[str]) -> bool:
    first = next((line for line in lines if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return not first.lstrip().startswith("[")


def first_json_error(path: Path) -> tuple[int, str] | None:
    """``(line, problem)`` of the first JSON syntax error of a JSON-lines or JSON file; None when it parses."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if not _is_json_lines(lines):
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            return error.lineno, f"{error.msg} at column {error.colno}"
        return None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            return number, f"{error.msg} at column {error.colno}"
        if not isinstance(value, dict):
            return number, f"expected one JSON object per line, got {type(value).__name__}"
    return None


def read_file(path: Path, builder: str) -> Dataset:
    """Load one local file with the ``datasets`` builder for its extension.

    Raises:
        ValueError: an empty file, or a file the builder cannot read: the message names the file and, for JSON, the
            line of the first syntax error (one message: the parser's traceback is not chained).
    """
    _check_not_empty(path)
    try:
        with _quiet(_JSON_LOADER_LOGGER):
            return load_dataset(builder, data_files=[str(path)], split="train", **_read_options(path, builder))
    except Exception as error:  # noqa: BLE001 - datasets wraps every parser error; we name the file and line instead
        found = first_json_error(path) if builder == "json" else None
        if found is not None:
            line, problem = found
            message = f"line {line} of {path}: not valid JSON ({problem}). Fix or remove that line."
        else:
            message = f"Cannot read {path} as {builder}: {_root_message(error)}"
    raise ValueError(message)


@cache
def _row_lines(path: Path, builder: str, modified: float) -> tuple[str, list[int]]:  # `modified`: cache key
    """``(unit, numbers)``: the 1-based line (or record/row) number of every row of a file, in row order."""
    if builder == "csv":
        with path.open(newline="", encoding="utf-8") as stream:
            reader, starts, previous_end = csv.reader(stream), [], 0
            for record in reader:
                if record:  # pandas skips blank lines
                    starts.append(previous_end + 1)
                previous_end = reader.line_num
        return "line", starts[1:]  # the first record is the header
    if builder == "json":
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if _is_json_lines(lines):
            return "line", [n for n, line in enumerate(lines, start=1) if line.strip()]
        return "record", []
    if builder == "text":
        return "line", []
    return "row", []


@dataclass(frozen=True)
class FilePart:
    """``rows`` consecutive rows of a loaded split that come from ``path``."""

    path: Path
    builder: str
    rows: int


class RowLocator:
    """``locator(index)``: where row ``index`` of a split loaded from files is, e.g. ``"line 7 of data/train.csv"``.

    Args:
        parts: the files of the split, in the order their rows were concatenated.
    """

    def __init__(self, parts: Sequence[FilePart]) -> None:
        self.parts = list(parts)

    def __call__(self, index: int) -> str:
        for part in self.parts:
            if index < part.rows:
                unit, numbers = _row_lines(part.path, part.builder, part.path.stat().st_mtime)
                number = numbers[index] if index < len(numbers) else index + 1
                return f"{unit} {number} of {part.path}"
            index -= part.rows
        raise IndexError(f"row {index} is past the end of {[str(p.path) for p in self.parts]}")
