"""Per-row sample lengths for the length-aware samplers, and padding diagnostics of a micro-batch.

:func:`check_lengths` validates the lengths a sampler is given, :func:`require_lengths` reads them from a data
module's length column (with errors that name the fix), and :func:`padding_stats` / :func:`cost_spread` are pure
diagnostics in the samplers' cost model (see :mod:`lit_trainer.data.samplers.rebalance`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lit_trainer.data.samplers.rebalance import QUADRATIC_COST_COEF


def check_lengths(lengths: Any, owner: str) -> list[int]:
    """Lengths as a list of non-negative ints, or a ValueError that names the fix."""
    fix = (
        "give one non-negative int per row (the data modules read the `length` column named by "
        "`length_column_name`, computed once at preprocessing), or use `sampling: random`."
    )
    if lengths is None:
        raise ValueError(f"`{owner}(lengths=None)` is invalid: {fix}")
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    out = list(lengths)
    for i, length in enumerate(out):
        if length is None or isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ValueError(f"`{owner}` got length {length!r} for row {i}: {fix}")
    if not out:
        raise ValueError(f"`{owner}` got no lengths: the training dataset is empty. Check the data source.")
    return [int(length) for length in out]


def require_lengths(
    dataset: Any, length_column_name: str = "length", *, sampling: str = "batch_rebalance"
) -> list[int]:
    """The per-row lengths a length-aware ``sampling`` needs, from the dataset's ``length_column_name`` column.

    Never recomputes lengths by reading rows (that would be a second pass over the data at fit time).

    Args:
        dataset: a map-style ``datasets.Dataset`` (or any object with ``column_names`` and column access).
        length_column_name: the column holding one token count per row.
        sampling: the strategy that asked (named in error messages).

    Returns:
        The lengths as a list of ints.

    Raises:
        ValueError: for an iterable (streaming) dataset, a dataset without the column, or missing/negative values.

    Example:
        >>> import datasets
        >>> require_lengths(datasets.Dataset.from_dict({"length": [3, 5]}), "length")
        [3, 5]
    """
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"`sampling: {sampling}` needs a map-style dataset with per-row lengths, but the training "
            f"dataset is iterable ({type(dataset).__name__}): there is no epoch order to rearrange. Use "
            "`sampling: random` (or `sequential`), or load the data as a map-style `datasets.Dataset`."
        )
    columns = getattr(dataset, "column_names", None)
    if columns is None or length_column_name not in columns:
        raise ValueError(
            f"`sampling: {sampling}` needs per-row lengths, but the training dataset has no column "
            f"`length_column_name={length_column_name!r}` (columns: {columns}). Add it at preprocessing, "
            f"e.g. `dataset.map(lambda row: {{{length_column_name!r}: len(row['input_ids'])}})`, point "
            "`length_column_name` at an existing length column, or use `sampling: random`."
        )
    column = (
        dataset.select_columns([length_column_name]).with_format("arrow")[:]
        if hasattr(dataset, "select_columns")
        else None
    )
    values = column.column(length_column_name).to_pylist() if column is not None else list(dataset[length_column_name])
    try:
        return check_lengths(values, f"sampling: {sampling}")
    except ValueError as err:
        raise ValueError(f"{err} (column `length_column_name={length_column_name!r}`)") from None


def padding_stats(lengths: torch.Tensor, padded_length: int | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Padding diagnostics of one micro-batch, as tensors (no host sync): log them, all-gather ``cost`` under DDP.

    Args:
        lengths: ``(B,)`` real tokens per row, e.g. ``attention_mask.sum(-1)``.
        padded_length: the batch's padded width (``input_ids.shape[1]``); default ``lengths.max()``.

    Returns:
        ``tokens`` (real tokens), ``padded_tokens`` (``B * width``), ``padding_fraction`` (``1 - tokens /
        padded_tokens``) and ``cost`` (the samplers' cost model, ``B * width + 0.001 * B * width**2``), float32.

    Example:
        >>> stats = padding_stats(torch.tensor([4, 2, 2]))  # 3 rows padded to 4: 12 slots, 8 real tokens
        >>> [round(float(stats[k]), 4) for k in ("tokens", "padded_tokens", "padding_fraction", "cost")]
        [8.0, 12.0, 0.3333, 12.048]
    """
    lengths = lengths.reshape(-1).to(torch.float32)
    width = (
        lengths.max()
        if padded_length is None
        else torch.as_tensor(padded_length, dtype=torch.float32, device=lengths.device)
    )
    rows = lengths.numel()
    tokens, padded = lengths.sum(), rows * width
    return {
        "tokens": tokens,
        "padded_tokens": padded,
        "padding_fraction": 1 - tokens / padded.clamp_min(1),
        "cost": padded + QUADRATIC_COST_COEF * rows * width * width,
    }


def cost_spread(costs: torch.Tensor) -> torch.Tensor:
    """Relative spread ``(max - min) / max`` of the ranks' micro-batch costs (0 = balanced; 0.5 = half idle).

    Args:
        costs: ``(W,)`` one ``padding_stats(...)["cost"]`` per rank, e.g. ``LightningModule.all_gather(cost)``, or
            ``(W, S)``: one spread per column (the training module's per-step costs of a logging window).

    Example:
        >>> round(float(cost_spread(torch.tensor([100.0, 80.0]))), 6)
        0.2
    """
    top = costs.max(dim=0).values
    return (top - costs.min(dim=0).values) / top.clamp_min(torch.finfo(costs.dtype).tiny)
