"""Collation of preference pairs (as TRL 1.16's DPO collator, docs/design.md#trl-dpo).

A micro-batch of B pairs becomes 2B right-padded rows, chosen rows ``0..B-1`` then rejected rows ``B..2B-1``, each
truncated to ``max_length`` on its own (first or last tokens), with ``input_ids``, ``attention_mask`` and the unshifted
``completion_mask``; precomputed reference log-probs travel along as ``ref_chosen_logps``/``ref_rejected_logps``
(B,) when the dataset has them, and a ``margin`` column as a float ``margin`` (B,) (see
:meth:`~lit_trainer.data.preference.PreferenceDataModule.set_reference_logps`). With ``packed=True`` the 2B rows are
one padding-free row instead (:func:`packed_pairs`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lit_trainer.data.collate import pad_right

TruncationMode = Literal["keep_start", "keep_end", "drop"]
REF_CHOSEN_KEY, REF_REJECTED_KEY = "ref_chosen_logps", "ref_rejected_logps"
MARGIN_KEY = "margin"  # the optional per-pair margin of reward-model data (TRL's RewardTrainer column)
# "drop": the data module keeps only pairs that fit, so the first max_length tokens are the whole row
_TRUNCATE = {"keep_start": lambda seq, n: seq[:n], "keep_end": lambda seq, n: seq[-n:], "drop": lambda seq, n: seq[:n]}


def end_with_eos(text: str, eos: str | None) -> str:
    """``text`` ending with the EOS string: appended unless it is already there (unchanged when there is no EOS).

    TRL 1.16's rule for standard (string) preference rows, so the text a reward model trains on; GRPO scores a reward
    model's standard-format completions the same way (:class:`~lit_trainer.rewards.RewardModelScorer`).

    Example:
        >>> end_with_eos("82", "</s>"), end_with_eos("82</s>", "</s>"), end_with_eos("82", None)
        ('82</s>', '82</s>', '82')
    """
    return text if not eos or text.endswith(eos) else text + eos


def same_model_inputs(
    prompt: list[int], chosen: list[int], rejected: list[int], max_length: int, truncation_mode: TruncationMode
) -> bool:
    """Whether a pair's chosen and rejected rows are the same model inputs once truncated as the collator does.

    Such a pair has a zero DPO gradient: both log-probabilities, and both reference log-probabilities, are equal.

    Example:
        >>> same_model_inputs([7], [5, 1], [5, 1], 8, "keep_start")
        True
        >>> same_model_inputs([7], [5, 1, 9], [5, 1, 8], 2, "keep_start")  # both rows are cut to [7, 5]
        True
    """
    cut = _TRUNCATE[truncation_mode]
    chosen_row, rejected_row = (
        (cut(prompt + c, max_length), cut([0] * len(prompt) + [1] * len(c), max_length)) for c in (chosen, rejected)
    )
    return chosen_row == rejected_row


def packed_pairs(ids: list[list[int]], masks: list[list[int]]) -> dict[str, torch.Tensor]:
    """The 2B rows (chosen then rejected) as one packed row: ``input_ids``, ``position_ids`` (restarting per row)
    and ``completion_mask`` of shape ``(1, total)``, and the rows' ``seq_lengths`` ``(2B,)`` that
    :func:`~lit_trainer.data.packing.unpack_rows` splits per-token values back into rows with."""
    return {
        "input_ids": torch.tensor([[t for row in ids for t in row]], dtype=torch.long),
        "position_ids": torch.tensor([[p for row in ids for p in range(len(row))]], dtype=torch.long),
        "completion_mask": torch.tensor([[m for row in masks for m in row]], dtype=torch.long),
        "seq_lengths": torch.tensor([len(row) for row in ids], dtype=torch.long),
    }


class PreferenceCollator:
    """Collate preference rows into one batch of 2B rows (chosen then rejected), right-padded.

    Args:
        pad_token_id: id used for padding ``input_ids`` (masked out by ``attention_mask``).
        max_length: per-row token budget, applied to each of the 2B rows on its own.
        truncation_mode: ``keep_start`` keeps a row's first ``max_length`` tokens, ``keep_end`` its last; ``drop``
            (the data module dropped every pair that does not fit) cuts nothing.
        pad_to_multiple_of: round the padded length up.
        packed: flatten the 2B rows into ONE padding-free row instead (:func:`packed_pairs`).
    """

    def __init__(
        self,
        pad_token_id: int,
        max_length: int,
        truncation_mode: TruncationMode = "keep_start",
        pad_to_multiple_of: int | None = None,
        packed: bool = False,
    ) -> None:
        self.pad_token_id, self.max_length, self.packed = pad_token_id, max_length, packed
        self.truncate, self.pad_to_multiple_of = _TRUNCATE[truncation_mode], pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, masks = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for row in rows:
                prompt, completion = row["prompt_ids"], row[key]
                ids.append(self.truncate(prompt + completion, self.max_length))
                masks.append(self.truncate([0] * len(prompt) + [1] * len(completion), self.max_length))
        batch = (
            packed_pairs(ids, masks)
            if self.packed
            else {
                "input_ids": pad_right(ids, self.pad_token_id, self.pad_to_multiple_of),
                "attention_mask": pad_right([[1] * len(s) for s in ids], 0, self.pad_to_multiple_of),
                "completion_mask": pad_right(masks, 0, self.pad_to_multiple_of),
            }
        )
        if all(REF_CHOSEN_KEY in row for row in rows):
            batch[REF_CHOSEN_KEY] = torch.tensor([row[REF_CHOSEN_KEY] for row in rows], dtype=torch.float32)
            batch[REF_REJECTED_KEY] = torch.tensor([row[REF_REJECTED_KEY] for row in rows], dtype=torch.float32)
        if all(MARGIN_KEY in row for row in rows):
            batch[MARGIN_KEY] = torch.tensor([float(row[MARGIN_KEY]) for row in rows], dtype=torch.float32)
        return batch
