"""Reading back what a run wrote to trackio's local store (``TRACKIO_DIR``, a temporary folder in the tests: see
``tests/conftest.py``), through trackio's own SQLite storage module."""

from __future__ import annotations

import uuid
from typing import Any


def new_project() -> str:
    """A project name no other test uses (the tests share one store)."""
    return f"test-{uuid.uuid4().hex[:12]}"


def runs(project: str) -> list[dict[str, Any]]:
    """The project's runs: ``[{"id": ..., "name": ...}, ...]``."""
    from trackio.sqlite_storage import SQLiteStorage

    return [{"id": r["id"], "name": r["name"]} for r in SQLiteStorage.get_run_records(project)]


def rows(project: str, run_id: str) -> list[dict[str, Any]]:
    """Every row the run logged (metrics plus ``step`` and ``timestamp``), in step order."""
    from trackio.sqlite_storage import SQLiteStorage

    return sorted(SQLiteStorage.get_logs(project, run_id=run_id), key=lambda row: row["step"])


def steps_of(project: str, run_id: str, key: str) -> list[int]:
    """The steps of the rows that hold ``key``, one entry per row (a step logged twice appears twice)."""
    return [row["step"] for row in rows(project, run_id) if key in row]


def config(project: str, run_id: str) -> dict[str, Any]:
    """The run's stored config: the logged hyper-parameters plus trackio's own entries (``_Username``,
    ``_Created``, ``_Group``)."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_config(project, run_id=run_id) or {}
