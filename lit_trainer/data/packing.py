"""Padding-free packing: best-fit-decreasing bins and the flattening of rows into one packed row.

A packed micro-batch is ONE row of concatenated token sequences with ``position_ids`` restarting at 0 at every
sequence start and no attention mask; transformers then builds a block-diagonal causal mask (``sdpa``, ``eager``,
``flex_attention``) or feeds the boundaries to the varlen kernels (``flash_attention_*``), so no sequence attends to
another one. The label of each sequence's first token is ``-100``: after the causal shift it would be predicted
from the previous sequence's last token, a prediction an unpacked batch never makes. Nothing is padded.

Modes (``packing`` of the data modules):

* ``"none"``: right-padded micro-batches (the default).
* ``"padding_free"``: the sampler's micro-batch of ``batch_size`` rows is flattened into one packed row.
* ``"bfd"``: at setup, the training rows are grouped into bins of at most ``capacity`` tokens by best-fit decreasing;
  the bin is the sampling unit (``batch_size`` counts bins) and each bin is one packed row of the micro-batch (the
  bins are right-padded to the longest one, with labels ``-100``). Rows are never split: a row longer than
  ``max_length`` is truncated at tokenization (as TRL's ``"bfd"``; TRL's ``"bfd_split"`` is not offered).

Cost: the ``sdpa`` and ``eager`` attentions apply the packed mask to the whole packed row, so their attention work
grows with the square of the packed row's length, not of each sequence's (the ``flash_attention_*`` varlen kernels
pay per sequence). ``"bfd"`` keeps packed rows at ``max_length``; ``"padding_free"`` makes one row of the whole
micro-batch, which on ``sdpa``/``eager`` pays off for short rows and small micro-batches.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from datasets import Dataset

from lit_trainer.losses.logprobs import IGNORE_INDEX

Packing = Literal["none", "padding_free", "bfd"]
PACKING_CHOICES: tuple[str, ...] = get_args(Packing)
PACKED_ROWS = "train_rows_packed"  # data-module ``stats`` key: the training rows packed into ``"bfd"`` bins


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group items into bins of total length ``<= capacity`` by best-fit decreasing.

    Items are taken longest first (ties by index) and each goes to the open bin it fills most tightly (the one with
    the least room that still fits; ties to the older bin), or to a new bin. Deterministic: a pure function of the
    lengths.

    Args:
        lengths: per-item token counts, each in ``[1, capacity]``.
        capacity: bin size in tokens.

    Returns:
        The bins, in creation order, each a list of item indices (longest first).

    Raises:
        ValueError: an item longer than ``capacity`` or a non-positive capacity.

    Example:
        >>> best_fit_decreasing([3, 5, 2, 4], capacity=7)
        [[1, 2], [3, 0]]
    """
    if capacity < 1:
        raise ValueError(f"The bin capacity {capacity} is invalid: it must be >= 1 token.")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = int(lengths[item])
        if size > capacity:
            raise ValueError(
                f"Item {item} has {size} tokens, more than the bin capacity {capacity}: "
                "truncate rows to the capacity first or raise it."
            )
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, index = free.pop(at)
        else:
            room, index = capacity, len(bins)
            bins.append([])
        bins[index].append(item)
        if room - size > 0:
            bisect.insort(free, (room - size, index))
    return bins


def flatten_sequences(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Concatenate sequences into one packed row: ``(input_ids, position_ids, labels)`` as flat lists.

    ``position_ids`` restart at 0 at each sequence; ``labels`` are the ids, with ``-100`` on each sequence's first
    ``max(prompt_length, 1)`` tokens (its prompt, and always its first token: see the module docstring). A sequence
    with a ``loss_mask`` (one 0/1 per token, chat rows) instead keeps the labels of the tokens it marks, still with
    ``-100`` on its first token; its prompt length then plays no part in the labels.

    Example:
        >>> flatten_sequences([[5, 6, 7], [8, 9]], [0, 1])
        ([5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [-100, 6, 7, -100, 9])
        >>> flatten_sequences([[5, 6, 7], [8, 9]], [0, 0], [[1, 0, 1], [1, 1]])[2]
        [-100, -100, 7, -100, 9]
    """
    ids: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    masks = loss_masks if loss_masks is not None else [None] * len(sequences)
    for seq, prompt, mask in zip(sequences, prompt_lengths, masks):
        if mask is None:
            hidden = min(max(int(prompt), 1), len(seq))
            mask = [0] * hidden + [1] * (len(seq) - hidden)
        ids.extend(seq)
        positions.extend(range(len(seq)))
        labels.extend(t if m and at > 0 else IGNORE_INDEX for at, (t, m) in enumerate(zip(seq, mask)))
    return ids, positions, labels


def row_starts(seq_lengths: Sequence[int]) -> list[int]:
    """Start offset of each sequence in a packed row.

    Example:
        >>> row_starts([3, 2, 4])
        [0, 3, 5]
    """
    starts, at = [], 0
    for n in seq_lengths:
        starts.append(at)
        at += int(n)
    return starts


def pack_dataset(rows: Dataset, capacity: int, length_column: str = "length") -> Dataset:
    """Tokenized rows (``input_ids``, ``prompt_length``, lengths in ``length_column``) as best-fit-decreasing bins.

    Each bin row holds the flat ``input_ids`` of its rows, their ``seq_lengths`` and ``prompt_lengths``, and its
    total token count in ``length_column`` (what the length-aware samplers read). Rows with a per-token
    ``loss_mask`` (chat rows) keep it: the bin then holds the flat ``loss_mask`` of its rows, aligned with its
    ``input_ids``.
    """
    lengths = rows[length_column]
    ids, prompts = rows["input_ids"], rows["prompt_length"] if "prompt_length" in rows.column_names else None
    masks = rows["loss_mask"] if "loss_mask" in rows.column_names else None
    out: dict[str, list] = {"input_ids": [], "seq_lengths": [], "prompt_lengths": [], length_column: []}
    if masks is not None:
        out["loss_mask"] = []
    for members in best_fit_decreasing(lengths, capacity):
        out["input_ids"].append([t for i in members for t in ids[i]])
        out["seq_lengths"].append([len(ids[i]) for i in members])
        out["prompt_lengths"].append([prompts[i] if prompts is not None else 0 for i in members])
        out[length_column].append(sum(len(ids[i]) for i in members))
        if masks is not None:
            out["loss_mask"].append([m for i in members for m in masks[i]])
    return Dataset.from_dict(out)


def check_packing_options(packing: str, max_tokens_per_batch: int | None, hparams: Any) -> None:
    """Validate ``packing`` and ``max_tokens_per_batch`` against a data module's other options.

    Raises:
        ValueError: an unknown ``packing``; ``max_tokens_per_batch`` without ``"bfd"``, below ``max_length`` or with
            ``batch_size != 1``.
    """
    if packing not in PACKING_CHOICES:
        raise ValueError(f"`packing={packing!r}` is invalid: choose one of {PACKING_CHOICES}.")
    if max_tokens_per_batch is not None:
        if packing != "bfd":
            raise ValueError(
                f"`max_tokens_per_batch={max_tokens_per_batch}` sizes the bins of `packing='bfd'`; "
                f"with `packing={packing!r}` set packing='bfd' or leave max_tokens_per_batch unset."
            )
        if max_tokens_per_batch < hparams.max_length:
            raise ValueError(
                f"`max_tokens_per_batch={max_tokens_per_batch}` is below `max_length="
                f"{hparams.max_length}`: a bin must hold the longest row; raise it or lower max_length."
            )
        if hparams.batch_size != 1:
            raise ValueError(
                f"`max_tokens_per_batch={max_tokens_per_batch}` makes each micro-batch one bin of that "
                f"many tokens: set `batch_size=1` (not {hparams.batch_size}), or leave "
                "max_tokens_per_batch unset to get `batch_size` bins of `max_length` tokens."
            )


def unpack_rows(flat: torch.Tensor, seq_lengths: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """Per-row values of a packed row, right-padded with zeros: ``(1, N, *rest)`` to ``(R, W, *rest)``.

    With ``shifted=False`` row ``r`` gets its ``seq_lengths[r]`` positions. With ``shifted=True`` ``flat`` holds
    values after the causal shift (entry ``t`` predicts token ``t + 1``) and row ``r`` gets its first
    ``seq_lengths[r] - 1`` entries, exactly what the same row alone yields after the shift; the entry at each
    row's end, which would predict the next row's first token, belongs to no row.

    Example:
        >>> unpack_rows(torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([3, 2])).tolist()
        [[1, 2, 3], [4, 5, 0]]
        >>> unpack_rows(torch.tensor([[1, 2, 3, 4]]), torch.tensor([3, 2]), shifted=True).tolist()
        [[1, 2], [4, 0]]
    """
    lengths = seq_lengths.to(flat.device)
    starts = torch.cumsum(lengths, 0) - lengths
    widths = lengths - 1 if shifted else lengths
    width = int(widths.max()) if widths.numel() else 0
    offsets = torch.arange(width, device=flat.device)
    valid = offsets[None, :] < widths[:, None]
    index = (starts[:, None] + offsets[None, :]).clamp(max=max(flat.size(1) - 1, 0))
    values = flat[0][index]
    return values.masked_fill(~valid.reshape(*valid.shape, *([1] * (values.dim() - 2))), 0)


def row_completion_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A preference batch's ``(2B, T)`` completion mask: as is when padded, split per row when packed."""
    if "seq_lengths" in batch:
        return unpack_rows(batch["completion_mask"], batch["seq_lengths"])
    return batch["completion_mask"]
