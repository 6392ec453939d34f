"""Read local data files, and say where a row came from: file and line (1-based, as an editor shows it).

A file that cannot be read raises ONE ``ValueError`` naming the file, the line and the problem (an empty file, bytes
that are not valid UTF-8, a line that is not valid JSON, a CSV parser error), instead of the parser's chained
tracebacks. CSV cells are read as text: ``"010"`` stays ``"010"``, ``"NA"`` stays ``"NA"``, and only an empty cell is
a missing value (which the data modules then report with its line and column).
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, Value, load_dataset

_EMPTY_CHECK_BYTES = 1 << 16  # a larger file is not checked for being all whitespace
_UTF8_CHUNK_BYTES = 1 << 24  # the UTF-8 check reads this much at a time
_TEXT_BUILDERS = ("json", "csv", "text")  # read as UTF-8 text (parquet is binary)
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


def check_utf8(path: Path) -> None:
    """Raise for the first bytes of a text data file that are not valid UTF-8, with their line and column.

    ``datasets`` would fail on them with a bare ``UnicodeDecodeError`` (or pyarrow's "Invalid UTF-8 sequence") that
    names neither the file nor the line, for JSON lines only when the rows are first read. The file is decoded in
    chunks, so a large file costs one pass and little memory.

    Raises:
        ValueError: ``"line 2 of data.jsonl: not valid UTF-8 (byte 0xff at character 14). ..."``.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines_before = column_before = 0  # complete lines, and characters of the current line, before this chunk
    with path.open("rb") as stream:
        while True:
            block = stream.read(_UTF8_CHUNK_BYTES)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                seen = error.object[: error.start]
                line_start = seen.rfind(b"\n") + 1
                column = (0 if line_start else column_before) + len(seen[line_start:].decode("utf-8", "replace"))
                line, byte = lines_before + seen.count(b"\n") + 1, error.object[error.start]
                break
            if not block:
                return
            lines_before += text.count("\n")
            column_before = len(text) - text.rfind("\n") - 1 if "\n" in text else column_before + len(text)
    raise ValueError(
        f"line {line} of {path}: not valid UTF-8 (byte 0x{byte:02x} at character {column + 1}). Data files are read as "
        "UTF-8: fix that line, or convert the file (e.g. `iconv -f latin1 -t utf-8 in.csv > out.csv`)."
    )


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


def _json_kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "number", float: "number", list: "list", dict: "object"}.get(type(value), "value")


def first_json_error(path: Path) -> tuple[int, str] | None:
    """``(line, problem)`` of the first problem a JSON-lines or JSON file has for ``datasets``: a syntax error, a line
    that is not an object, or (JSON lines) a column whose type changes from one line to another. None if none."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if not _is_json_lines(lines):
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            return error.lineno, f"not valid JSON ({error.msg} at column {error.colno})"
        return None
    kinds: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            return number, f"not valid JSON ({error.msg} at column {error.colno})"
        if not isinstance(row, dict):
            return number, f"expected one JSON object per line, got {type(row).__name__}"
        for column, value in row.items():
            kind, first = _json_kind(value), kinds.get(column)
            if kind is not None and first is not None and first[0] != kind:
                return number, (
                    f"column {column!r} holds a {kind} here but a {first[0]} on line {first[1]} (a column "
                    "has one type: quote the numbers of a text column)"
                )
            if kind is not None and first is None:
                kinds[column] = (kind, number)
    return None


def read_file(path: Path, builder: str) -> Dataset:
    """Load one local file with the ``datasets`` builder for its extension.

    Raises:
        ValueError: an empty file, a JSON, CSV or text file that is not valid UTF-8 (with the line), or a file the
            builder cannot read: the message names the file and, for JSON, the line of the first problem (a syntax
            error, or a column whose type changes); one message, the parser's traceback is not chained.
    """
    _check_not_empty(path)
    if builder in _TEXT_BUILDERS:
        check_utf8(path)
    try:
        options = _read_options(path, builder)
        with _quiet(_JSON_LOADER_LOGGER):
            return load_dataset(builder, data_files=[str(path)], split="train", **options)
    except Exception as error:
        found = first_json_error(path) if builder == "json" else None
        if found is not None:
            line, problem = found
            message = f"line {line} of {path}: {problem}. Fix or remove that line."
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

    def first_raw_problem(self, column: str, problem: Callable[[Any], str | None]) -> tuple[str, str] | None:
        """``(where, problem)`` of the first row whose value AS WRITTEN in a JSON-lines file has a problem.

        ``datasets`` casts a JSON column to one type (``"1"`` and ``2`` become ``1`` and ``2``), so the loaded value
        of a row can hide which line is wrong; the raw lines cannot. None when the files are not JSON lines.
        """
        for part in self.parts:
            if part.builder != "json":
                return None
            lines = part.path.read_text(encoding="utf-8", errors="replace").splitlines()
            if not _is_json_lines(lines):
                return None
            for number, line in enumerate(lines, start=1):
                if line.strip() and (found := problem(json.loads(line).get(column))) is not None:
                    return f"line {number} of {part.path}", found
        return None

    def __call__(self, index: int) -> str:
        for part in self.parts:
            if index < part.rows:
                unit, numbers = _row_lines(part.path, part.builder, part.path.stat().st_mtime)
                number = numbers[index] if index < len(numbers) else index + 1
                return f"{unit} {number} of {part.path}"
            index -= part.rows
        raise IndexError(f"row {index} is past the end of {[str(p.path) for p in self.parts]}")
