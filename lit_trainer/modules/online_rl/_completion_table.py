"""The completions table of :class:`~lit_trainer.modules.grpo.GRPOModule` (``log_completions``): one function writes
it to the console and to every logger of the run.

* console: a ``rich`` table of ``num_completions_to_print`` rows (all when None), chosen with a generator seeded by
  the step (never the global RNG, so logging does not change a run);
* a ``CSVLogger``: ``completions.csv`` in its ``log_dir``, appended, with the step;
* a ``TensorBoardLogger``: a markdown table through ``add_text("completions", ...)``;
* any other logger with a ``log_table(key=..., columns=..., data=..., step=...)`` method (Lightning's WandbLogger, a
  Trackio logger): called with ``key="completions"``.

Loggers are recognised by class name (``lightning.pytorch`` and ``pytorch_lightning`` have one class each) or by the
``log_table`` method. The rank that calls it (rank 0) passes the rows of every rank.
"""

from __future__ import annotations

import csv
import os
import random
from collections.abc import Iterable, Sequence
from typing import Any

CSV_NAME = "completions.csv"
TABLE_KEY = "completions"


def render_text(value: Any) -> str:
    """A prompt or completion as text: strings unchanged, a conversation as ``role: content`` lines (structured
    contents as their text parts, each image part as ``<image>``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '')}: {_content_text(m.get('content', ''))}" for m in value)
    return str(value)


def _content_text(content: Any) -> str:
    if isinstance(content, (list, tuple)) and all(isinstance(p, dict) for p in content):
        return "".join("<image>" if p.get("type") == "image" else str(p.get("text") or "") for p in content)
    return str(content)


def write_completion_table(
    loggers: Iterable[Any],
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    step: int,
    *,
    num_to_print: int | None = None,
    console: bool = True,
    unique_prompts: bool = False,
) -> None:
    """Write one completions table to the console and to each logger (see the module docstring).

    Args:
        loggers: the trainer's loggers (``trainer.loggers``).
        columns: column names, e.g. ``["prompt", "completion", "<reward fn>", ..., "advantage"]``.
        rows: one sequence of values per completion, in ``columns`` order.
        step: the training step the table belongs to.
        num_to_print: rows shown on the console (a seeded random sample); None = all. Loggers get every row.
        console: print the rich table.
        unique_prompts: the loggers get only the first row of each prompt (TRL's ``log_unique_prompts``; the first
            column is the prompt, compared by its text); the console sample is drawn from every row.
    """
    if console:
        _print_rich(columns, rows, step, num_to_print)
    if unique_prompts:
        seen: set[str] = set()
        rows = [row for row in rows if not (render_text(row[0]) in seen or seen.add(render_text(row[0])))]
    for logger in loggers:
        if _is_a(logger, "CSVLogger"):
            _append_csv(os.path.join(logger.log_dir, CSV_NAME), columns, rows, step)
        elif _is_a(logger, "TensorBoardLogger"):
            logger.experiment.add_text(TABLE_KEY, markdown_table(columns, rows), global_step=step)
        elif callable(getattr(logger, "log_table", None)):
            logger.log_table(key=TABLE_KEY, columns=list(columns), data=[list(r) for r in rows], step=step)


def _is_a(logger: Any, class_name: str) -> bool:
    return any(cls.__name__ == class_name for cls in type(logger).__mro__)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (``|`` escaped, newlines as ``<br>``), as TensorBoard renders it."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _append_csv(path: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
    header = ["step", *columns]
    exists = os.path.exists(path)
    if exists:
        with open(path, newline="", encoding="utf-8") as f:
            old = next(csv.reader(f), None)
        if old is not None and old != header:
            raise ValueError(f"{path} has columns {old}, this run logs {header}: use a new log directory.")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if not exists:
            writer.writerow(header)
        writer.writerows([step, *row] for row in rows)


def _print_rich(columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int, num: int | None) -> None:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    indices = list(range(len(rows)))
    if num is not None and num < len(rows):
        indices = sorted(random.Random(step).sample(indices, num))  # a local generator: the run's RNG is untouched
    table = Table(show_header=True, header_style="bold white", expand=True, show_lines=True)
    for i, name in enumerate(columns):
        numeric = any(isinstance(rows[j][i], (int, float)) for j in indices)
        table.add_column(name, justify="right" if numeric else "left")
    for j in indices:
        table.add_row(*(f"{v:.2f}" if isinstance(v, float) else str(v) for v in rows[j]))
    Console().print(Panel(table, title=f"Step {step}", expand=False))
