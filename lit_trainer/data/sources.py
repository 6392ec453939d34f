"""Where the rows come from: the built-in task, a reasoning-gym task, local files, a hub dataset, or a ``datasets``
object.

Rows loaded from local files carry a locator (see :mod:`lit_trainer.data.files`), so that a data module can name the
file and line of a bad row; rows from elsewhere are named by their index.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from datasets import Dataset, DatasetDict, IterableDataset, concatenate_datasets, load_dataset

from lit_trainer.data import reasoning_gym
from lit_trainer.data.files import FilePart, RowLocator, read_file
from lit_trainer.data.reasoning_gym import TaskRows

_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text"}
VALIDATION_SPLITS = ("validation", "valid", "val", "test", "eval")
Locator = Callable[[int], str]


class Located(NamedTuple):
    """Rows and, when they were read from local files, ``where(index) -> "line 7 of data.csv"`` (else None)."""

    rows: Dataset
    where: Locator | None


def _builder_for(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _EXTENSIONS)
    if not files:
        raise ValueError(f"No data file with a known extension {sorted(_EXTENSIONS)} in {str(path)!r}.")
    builder = _EXTENSIONS.get(files[0].suffix)
    if builder is None:
        raise ValueError(f"Cannot read {str(path)!r}: use one of the extensions {sorted(_EXTENSIONS)}.")
    return builder


def _read_files(files: list[Path], builder: str) -> Located:
    parts = [read_file(path, builder) for path in files]
    rows = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    return Located(rows, RowLocator([FilePart(path, builder, len(p)) for path, p in zip(files, parts)]))


def _load_local(path: Path) -> dict[str, Located]:
    builder = _builder_for(path)
    if path.is_file():
        return {"train": _read_files([path], builder)}
    split_files: dict[str, list[Path]] = {"train": []}
    for name in sorted(p for p in path.iterdir() if p.suffix in _EXTENSIONS):
        stem = name.stem.lower()
        split = next((s for s in VALIDATION_SPLITS if stem == s or stem.startswith(s + "-")), "train")
        split_files.setdefault(split, []).append(name)
    return {split: _read_files(files, builder) for split, files in split_files.items() if files}


def load_located_rows(
    source: str | Dataset | DatasetDict,
    builtin: dict[str, Callable[[str], Dataset]],
    *,
    split: str | None = None,
    task_rows: TaskRows | None = None,
) -> tuple[Located, Located | None]:
    """Load ``(train, validation-or-None)`` rows from a source, with file locators for local files.

    Args:
        source: ``"builtin:<name>"``; a local ``.json/.jsonl/.csv/.parquet/.txt`` file or a directory of them (files
            named ``validation*``/``test*`` become the validation split); a ``datasets.Dataset``/``DatasetDict``
            object; otherwise a hub dataset name (for real users; tests never download).
        builtin: ``{"builtin:<name>": fn(split) -> Dataset}`` for this data module's row format.
        split: the training split of a hub dataset (default ``"train"``).
        task_rows: the rows a ``"reasoning_gym:<task>"`` source is generated as
            (:mod:`lit_trainer.data.reasoning_gym`); None = this data module does not read such sources.

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
        ValueError: an unknown built-in name, an iterable dataset, an unreadable file type, or a file that cannot be
            read (empty, not valid JSON, ...): the message names the file and line.
    """
    if isinstance(source, IterableDataset):
        raise ValueError("Iterable (streaming) datasets are not supported: load a map-style `datasets.Dataset`.")
    if isinstance(source, Dataset):
        return Located(source, None), None
    if isinstance(source, DatasetDict):
        return _pick_splits({name: Located(rows, None) for name, rows in source.items()}, split)
    if not isinstance(source, str):
        raise ValueError(f"`dataset` must be a string or a datasets.Dataset, got {type(source).__name__}.")
    if source.startswith("builtin:"):
        if source not in builtin:
            raise ValueError(f"Unknown built-in dataset {source!r}: valid ones are {sorted(builtin)}.")
        return Located(builtin[source]("train"), None), Located(builtin[source]("validation"), None)
    if source.startswith(reasoning_gym.PREFIX):
        if task_rows is None:
            raise ValueError(
                f"{source!r}: this data module does not read reasoning-gym tasks (SFT, prompt and "
                "preference data modules do)."
            )
        return (
            Located(reasoning_gym.rows(source, "train", task_rows), None),
            Located(reasoning_gym.rows(source, "validation", task_rows), None),
        )
    path = Path(source).expanduser()
    if path.exists():
        return _pick_splits(_load_local(path), split)
    if source.startswith(("/", ".", "~")) or path.suffix in _EXTENSIONS or source.count("/") > 1:
        raise FileNotFoundError(
            f"Data path {source!r} does not exist: give an existing file or directory, a hub "
            f"dataset name, or one of {sorted(builtin)}."
        )
    return _pick_splits({name: Located(rows, None) for name, rows in load_dataset(source).items()}, split)


def _pick_splits(data: dict[str, Located], split: str | None) -> tuple[Located, Located | None]:
    train_split = split or "train"
    if train_split not in data:
        raise ValueError(f"Split {train_split!r} not found; available splits: {sorted(data)}. Set `split`.")
    validation = next((data[s] for s in VALIDATION_SPLITS if s in data and s != train_split), None)
    return data[train_split], validation


def split_validation(train: Dataset, val_size: float | int, seed: int) -> tuple[Dataset, Dataset | None]:
    """Hold out ``val_size`` rows (a fraction in (0, 1) or a count) with a seeded shuffle; 0 = no validation.

    Raises:
        ValueError: when ``val_size`` is negative, or leaves no training row.
    """
    if val_size < 0:
        raise ValueError(f"`val_size={val_size}` is invalid: use 0 (no validation), a fraction in (0, 1) or a count.")
    if val_size == 0:
        return train, None
    count = round(val_size * len(train)) if isinstance(val_size, float) and val_size < 1 else int(val_size)
    if not 0 < count < len(train):
        raise ValueError(
            f"`val_size={val_size}` leaves {len(train) - count} of {len(train)} rows for training; "
            "lower it or add data."
        )
    parts = train.train_test_split(test_size=count, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def describe_columns(data: Dataset) -> str:
    """``"'a', 'b'"``: the columns of a dataset, for error messages."""
    return ", ".join(repr(c) for c in data.column_names)


def any_to_str(value: Any) -> str:
    """Short description of a data source for log messages."""
    return value if isinstance(value, str) else f"<{type(value).__name__} with {len(value)} rows>"


def missing_or_not_text(value: Any) -> str | None:
    """What is wrong with a cell that should hold text (None when it is a string)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "the value is missing (an empty cell or null)"
    if not isinstance(value, str):
        return f"expected text, got {type(value).__name__} {value!r:.60}"
    return None


def check_cells(
    rows: Dataset, columns: Iterable[str], where: Locator, problem: Callable[[Any], str | None], what: str
) -> None:
    """Raise for the first cell of ``columns`` for which ``problem(value)`` is not None.

    Raises:
        ValueError: ``"Bad <what> at line 4 of data.csv, column 'completion': the value is missing ..."``.
    """
    for column in columns:
        for index, value in enumerate(rows[column]):
            found = problem(value)
            if found is not None:
                place, found = locate_problem(where, index, column, problem, found)
                raise ValueError(f"Bad {what} at {place}, column {column!r}: {found}. Fix or drop that row.")


def locate_problem(
    where: Locator, index: int, column: str, problem: Callable[[Any], str | None], found: str
) -> tuple[str, str]:
    """``(place, problem)`` to report for a bad cell found at loaded row ``index``.

    For JSON-lines files the first line whose value as written has a problem wins: ``datasets`` may have cast the
    column (``"1"`` and ``2`` both load as numbers), which moves the visible problem to an earlier, correct line.
    """
    raw = where.first_raw_problem(column, problem) if isinstance(where, RowLocator) else None
    return raw or (where(index), found)
