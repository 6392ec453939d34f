"""Training rows that cannot be loaded: named in their source, and either the run stops (after a checkpoint) or the
row is skipped.

Text rows are tokenized at setup, where a bad row stops the run before training with its file and line. Rows with
images keep their pictures undecoded until their batch is built (``lit_trainer.data.vision``), so a picture that does
not decode (a truncated PNG, a path to a file that is not an image) is met during training. What happens then:

* the batch is collated again row by row to find the rows that fail alone (a failure of the rows only together is no
  row's: it is raised as it is);
* by default (``skip_bad_rows=False``) the run stops with one line naming the first bad row in its source (the file
  and line of a JSON-lines/CSV row, else the row's index in the dataset as given, before the validation split) and the
  error. The training loader builds the batches of an optimizer step together, before the step's first batch trains,
  so the last finished optimizer step is whole: a :class:`~lit_trainer.callbacks.JITCheckpoint` among the callbacks
  saves it first (``lit_trainer.core.stop_request.stop_for_failure``), and ``--ckpt_path last`` continues once the row
  is fixed (or with ``skip_bad_rows=True``);
* with ``skip_bad_rows=True`` each bad row is replaced in its batch by the batch's first good row (by the first good
  row of the training data when none is), so the batch keeps its size: a GRPO group stays whole (its repeated prompt
  is replaced by one prompt) and the ranks of DDP keep the same number of batches. The rows are counted
  (``data/skipped_rows``, summed over ranks, since the fit started) and named in a warning: each of the first
  :data:`NAMED_WARNINGS`, then at most one warning a minute.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from lit_trainer.data.vision.rows import ROW_KEY

SKIPPED_KEY = "_skipped_rows"
"""A batch's skipped rows (their descriptions), put in by :class:`GuardedCollate` and taken out by the loader."""
NAMED_WARNINGS = 10
"""Skipped rows named in a warning each before the warnings are rate-limited."""
WARNING_INTERVAL = 60.0
"""Seconds between two warnings once :data:`NAMED_WARNINGS` rows were named."""


class BadRowError(ValueError):
    """A training row that cannot be loaded, decoded or collated: the message, one line, names the row in its source
    and the error (e.g. ``"line 7 of data/train.jsonl: the file 'img/7.png' does not decode as an image (...)"``)."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def describe(place: str, error: BaseException) -> str:
    """``"<place>: <error>"`` in one line; the error alone when its message names ``place`` already."""
    message = _one_line(str(error)) or type(error).__name__
    return message if place in message else f"{place}: {message}"


def reason(error: BaseException) -> str:
    """The one-line message of a :class:`BadRowError`, also when a ``DataLoader`` worker raised it (torch re-raises
    it in the main process with the worker's traceback in front)."""
    text = str(error)
    marker = f"{BadRowError.__name__}: "
    return _one_line(text.rsplit(marker, 1)[1] if text.startswith("Caught ") and marker in text else text)


class GuardedCollate:
    """A training collate function that names, and with ``skip`` replaces, the rows it cannot collate.

    Args:
        collate: rows -> batch (a dict).
        place: where a row is in its source (``"line 7 of data.jsonl"``).
        skip: replace bad rows instead of raising.
        dataset: the training data as it is now, searched for a good row when no row of a batch is good.

    Raises:
        BadRowError: without ``skip``, for the first row of a batch that fails alone (the others are not tried
            further); with ``skip``, when no row of the training data can be collated.
    """

    def __init__(
        self,
        collate: Callable[[list[dict[str, Any]]], Any],
        place: Callable[[Mapping[str, Any]], str],
        skip: bool,
        dataset: Callable[[], Any],
    ) -> None:
        self.collate, self.place, self.skip, self.dataset = collate, place, skip, dataset
        self._fallback: dict[str, Any] | None = None

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        try:
            return self.collate(rows)
        except Exception as error:  # any failure of a row's loading or processing: found row by row below
            bad = self._bad_rows(rows, error)
            if not bad:
                raise
        if not self.skip:
            raise BadRowError(next(iter(bad.values())))
        good = [row for i, row in enumerate(rows) if i not in bad]
        fill = good[0] if good else self._first_good_row()
        batch = self.collate([fill if i in bad else row for i, row in enumerate(rows)])
        batch[SKIPPED_KEY] = list(dict.fromkeys(bad.values()))  # a GRPO prompt's repeats: named once
        return batch

    def _bad_rows(self, rows: list[dict[str, Any]], error: Exception) -> dict[int, str]:
        """``{index in the batch: description}`` of the rows that fail alone (one row: ``error`` is its own)."""
        if len(rows) == 1:
            return {0: describe(self.place(rows[0]), error)}
        bad, seen = {}, {}
        for i, row in enumerate(rows):
            key = row.get(ROW_KEY, f"at {i}")  # a GRPO prompt's repeats are one row: tried once
            if key not in seen:
                try:
                    self.collate([row])
                    seen[key] = None
                except Exception as alone:
                    seen[key] = describe(self.place(row), alone)
            if seen[key] is not None:
                bad[i] = seen[key]
        return bad

    def _first_good_row(self) -> dict[str, Any]:
        if self._fallback is None:
            data = self.dataset()
            for index in range(len(data)):
                try:
                    self.collate([data[index]])
                except Exception:
                    continue
                self._fallback = data[index]
                break
            else:
                raise BadRowError("skip_bad_rows=True, but no row of the training data can be loaded.")
        return self._fallback


class BadRows:
    """What a training loader does with a batch that holds bad rows (see the module docstring).

    Args:
        skip: whether bad rows are skipped (the data module's ``skip_bad_rows``); :attr:`skipped_rows` is None
            otherwise.
        stop: called with the one-line reason before the error is raised: it may save the last finished optimizer
            step and stop the run itself (the data modules pass ``stop_for_failure`` with their trainer).
    """

    def __init__(self, skip: bool, stop: Callable[[str], None] | None = None) -> None:
        self.skip, self.stop = skip, stop
        self.skipped_rows: int | None = 0 if skip else None
        self._named, self._last_warning, self._unnamed = 0, -float("inf"), 0

    def fail(self, error: BaseException) -> None:
        """Stop for a bad row: ``stop`` may save and stop; else raise :class:`BadRowError` (one line)."""
        message = reason(error)
        if self.stop is not None:
            self.stop(message)
        raise BadRowError(message) from None

    def take(self, batch: Any) -> Any:
        """Take the skipped rows out of a batch (count them, warn); the batch without them."""
        if not isinstance(batch, dict) or SKIPPED_KEY not in batch:
            return batch
        for description in batch.pop(SKIPPED_KEY):
            self.skipped_rows = (self.skipped_rows or 0) + 1
            self._warn(description)
        return batch

    def _warn(self, description: str) -> None:
        now = time.monotonic()
        if self._named < NAMED_WARNINGS or now - self._last_warning >= WARNING_INTERVAL:
            more = f" ({self._unnamed} more skipped since the last warning)" if self._unnamed else ""
            last = " Further skipped rows are counted in data/skipped_rows, with at most one warning a minute."
            self._named += 1
            self._last_warning, self._unnamed = now, 0
            warnings.warn(
                f"[lit_trainer] skip_bad_rows=True: skipped {description}{more}."
                + (last if self._named == NAMED_WARNINGS else ""),
                stacklevel=2,
            )
        else:
            self._unnamed += 1
