"""Where the rows come from: the built-in task, local files, a hub dataset, or a ``datasets`` object."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, IterableDataset, load_dataset

_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
               ".text": "text"}
VALIDATION_SPLITS = ("validation", "valid", "val", "test", "eval")


def _builder_for(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _EXTENSIONS)
    if not files:
        raise ValueError(f"No data file with a known extension {sorted(_EXTENSIONS)} in {str(path)!r}.")
    builder = _EXTENSIONS.get(files[0].suffix)
    if builder is None:
        raise ValueError(f"Cannot read {str(path)!r}: use one of the extensions {sorted(_EXTENSIONS)}.")
    return builder


def _load_local(path: Path) -> DatasetDict:
    builder = _builder_for(path)
    if path.is_file():
        return load_dataset(builder, data_files={"train": str(path)})
    files = sorted(str(p) for p in path.iterdir() if p.suffix in _EXTENSIONS)
    split_files: dict[str, list[str]] = {"train": []}
    for name in files:
        stem = Path(name).stem.lower()
        split = next((s for s in VALIDATION_SPLITS if stem == s or stem.startswith(s + "-")), "train")
        split_files.setdefault(split, []).append(name)
    return load_dataset(builder, data_files={k: v for k, v in split_files.items() if v})


def load_rows(
    source: str | Dataset | DatasetDict,
    builtin: dict[str, Callable[[str], Dataset]],
    *,
    split: str | None = None,
) -> tuple[Dataset, Dataset | None]:
    """Load ``(train, validation-or-None)`` rows from a source.

    Args:
        source: ``"builtin:<name>"``; a local ``.json/.jsonl/.csv/.parquet/.txt`` file or a directory of them (files
            named ``validation*``/``test*`` become the validation split); a ``datasets.Dataset``/``DatasetDict``
            object; otherwise a hub dataset name (for real users; tests never download).
        builtin: ``{"builtin:<name>": fn(split) -> Dataset}`` for this data module's row format.
        split: the training split of a hub dataset (default ``"train"``).

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
        ValueError: an unknown built-in name, an iterable dataset, or an unreadable file type.
    """
    if isinstance(source, IterableDataset):
        raise ValueError("Iterable (streaming) datasets are not supported: load a map-style `datasets.Dataset`.")
    if isinstance(source, Dataset):
        return source, None
    if isinstance(source, DatasetDict):
        return _pick_splits(source, split)
    if not isinstance(source, str):
        raise ValueError(f"`dataset` must be a string or a datasets.Dataset, got {type(source).__name__}.")
    if source.startswith("builtin:"):
        if source not in builtin:
            raise ValueError(f"Unknown built-in dataset {source!r}: valid ones are {sorted(builtin)}.")
        return builtin[source]("train"), builtin[source]("validation")
    path = Path(source).expanduser()
    if path.exists():
        return _pick_splits(_load_local(path), split)
    if source.startswith(("/", ".", "~")) or path.suffix in _EXTENSIONS or source.count("/") > 1:
        raise FileNotFoundError(f"Data path {source!r} does not exist: give an existing file or directory, a hub "
                                f"dataset name, or one of {sorted(builtin)}.")
    return _pick_splits(load_dataset(source), split)


def _pick_splits(data: DatasetDict, split: str | None) -> tuple[Dataset, Dataset | None]:
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
    count = int(round(val_size * len(train))) if isinstance(val_size, float) and val_size < 1 else int(val_size)
    if not 0 < count < len(train):
        raise ValueError(f"`val_size={val_size}` leaves {len(train) - count} of {len(train)} rows for training; "
                         "lower it or add data.")
    parts = train.train_test_split(test_size=count, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def describe_columns(data: Dataset) -> str:
    """``"'a', 'b'"``: the columns of a dataset, for error messages."""
    return ", ".join(repr(c) for c in data.column_names)


def any_to_str(value: Any) -> str:
    """Short description of a data source for log messages."""
    return value if isinstance(value, str) else f"<{type(value).__name__} with {len(value)} rows>"
