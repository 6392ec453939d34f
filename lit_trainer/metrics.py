"""Streaming evaluation metrics (torchmetrics): memory independent of the evaluation set size.

The HF Trainer concatenates every batch's logits before ``compute_metrics`` (docs/design.md#hf-eval-metrics); these
metrics are updated batch by batch and reduced across ranks once, in ``compute()``. :class:`ValidationMetrics` is
how every module declares them, and how the base module computes, logs and resets them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection

from lit_trainer.losses.causal_lm import causal_lm_loss
from lit_trainer.losses.logprobs import IGNORE_INDEX, shift_for_next_token

M = TypeVar("M", bound=Metric | MetricCollection)


class ValidationMetrics(torch.nn.Module):
    """A module's validation metrics by logged name: the one path from ``validation_step`` to the logger.

    A module registers its torchmetrics with :meth:`add` in ``__init__`` and updates them in ``validation_step``;
    :class:`~lit_trainer.modules.base.BaseModule` calls :meth:`compute` once at the end of each validation
    (torchmetrics reduces the states over the DDP ranks there), passes the values through its
    ``finalize_val_metrics`` hook, logs them and calls :meth:`reset`. Only metrics updated since the last reset are
    computed, so an optional metric (greedy exact match, say) never shows up as a meaningless 0 or nan. The metrics
    are submodules (they follow the module's device); their states stay out of checkpoints (torchmetrics' default).

    Entries are kept in order and may share a name: each keeps its own state, and the last one added wins in the
    logged values (as a dict would).
    """

    def __init__(self, prefix: str = "val_") -> None:
        super().__init__()
        self.prefix = prefix
        self.entries = torch.nn.ModuleList()
        self.names: list[str] = []

    def add(self, name: str, metric: M) -> M:
        """Register ``metric``, logged as ``prefix + name`` (a ``Metric`` whose ``compute`` returns a dict, or a
        ``MetricCollection``, is logged as ``prefix + key`` per key); returns it."""
        if not name:
            raise ValueError(f"`ValidationMetrics.add(name={name!r})` is invalid: a name must not be empty.")
        if not isinstance(metric, (Metric, MetricCollection)):
            raise TypeError(
                f"`ValidationMetrics.add({name!r}, {type(metric).__name__})` is invalid: give a "
                "torchmetrics `Metric` or `MetricCollection`."
            )
        self.entries.append(metric)
        self.names.append(name)
        return metric

    def __getitem__(self, name: str) -> Any:
        """The metric last added under ``name``."""
        for entry_name, metric in zip(reversed(self.names), reversed(self.entries)):
            if entry_name == name:
                return metric
        raise KeyError(f"No validation metric named {name!r}; the names are {self.names}.")

    def compute(self) -> dict[str, Tensor]:
        """``{prefix + name: value}`` of every metric updated since the last reset, reduced over ranks."""
        values: dict[str, Tensor] = {}
        for name, metric in zip(self.names, self.entries):
            if not _updated(metric):
                continue
            value = metric.compute()
            if isinstance(value, dict):
                values.update({f"{self.prefix}{key}": v for key, v in value.items()})
            else:
                values[f"{self.prefix}{name}"] = value
        return values

    def reset(self) -> None:
        """Clear every state for the next validation."""
        for metric in self.entries:
            metric.reset()


def _updated(metric: Metric | MetricCollection) -> bool:
    if isinstance(metric, MetricCollection):
        return any(m.update_called for m in metric.values(copy_state=False))
    return metric.update_called


@torch.no_grad()
def token_loss_and_accuracy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Next-token cross entropy and accuracy of ``(B, T, V)`` logits against unshifted labels, each a mean over the
    target tokens (``labels != -100`` after the shift), and that token count: update a ``MeanMetric`` with
    ``weight=count`` for the evaluation set's token mean (not the HF Trainer's mean of per-batch means)."""
    shifted, targets = shift_for_next_token(logits, labels)
    mask = targets != IGNORE_INDEX
    count = mask.sum()
    loss_sum = causal_lm_loss(logits, labels, num_items_in_batch=1)  # the summed cross entropy (float32)
    correct = ((shifted.argmax(-1) == targets) & mask).sum()
    return loss_sum / count, correct / count, count


def greedy_exact_match(generated: Tensor, targets: Tensor, eos_token_id: int | Sequence[int] | None) -> Tensor:
    """Per-row exact match of generated completions against reference completions.

    Both are cut at their first EOS: a chat template's text after the end-of-turn token (ChatML's newline after
    ``<|im_end|>``) is part of the reference row, never of what the model answers.

    Args:
        generated: ``(B, G)`` new tokens from ``generate`` (padded after EOS with the pad id).
        targets: ``(B, C)`` reference completion ids, ``-100`` padded; their EOS (if any) is not required in
            ``generated`` but nothing other than pad/EOS may follow the matched answer.
        eos_token_id: the EOS id (or ids) ending a completion.

    Returns:
        ``(B,)`` bool.
    """
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)

    def until_eos(ids: list[int]) -> list[int] | None:
        return next((ids[:i] for i, token in enumerate(ids) if token in eos), None)

    results = []
    for gen, tgt in zip(generated.tolist(), targets.tolist()):
        tgt = [t for t in tgt if t != IGNORE_INDEX]
        reference = until_eos(tgt)
        tgt = tgt if reference is None else reference
        answer = until_eos(gen)
        results.append((gen[: len(tgt) + 1] if answer is None else answer) == tgt)
    return torch.tensor(results, dtype=torch.bool)


@torch.no_grad()
def greedy_batch_matches(
    model: Any,
    batch: dict[str, Tensor],
    *,
    max_new_tokens: int,
    pad_token_id: int | None,
    eos_token_id: int | list[int] | None,
    synced_gpus: bool = False,
    **images: Tensor,
) -> Tensor:
    """Greedy exact match of a validation batch's rows that have a prompt: ``model.generate`` from the left-padded
    ``prompt_input_ids``/``prompt_attention_mask``, compared with ``completion_ids`` (:func:`greedy_exact_match`; the
    first EOS id ends a completion). ``synced_gpus``: the model is sharded, so ranks keep stepping until all are done.
    ``images``: a vision-language batch's image inputs, given only when every row has a prompt (they go with all rows).

    Returns:
        ``(R,)`` bool, one per row with a prompt.
    """
    prompts, mask = batch["prompt_input_ids"], batch["prompt_attention_mask"]
    has_prompt = mask.sum(-1) > 0
    generated = model.generate(
        input_ids=prompts[has_prompt],
        attention_mask=mask[has_prompt],
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        synced_gpus=synced_gpus,
        **images,
    )[:, prompts.size(1) :]
    return greedy_exact_match(generated.cpu(), batch["completion_ids"][has_prompt].cpu(), eos_token_id)
