"""KTO's label balance is checked at setup: data with one kind of label only (all thumbs up, or all down) warns once,
naming the counts and why (the KL reference point and the two weights assume both kinds); unequal counts with weights
that do not balance them warn as TRL 1.16 does (the KTO paper's Eq. 8), with the ranges that would."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
from datasets import Dataset

from helpers.models import tiny_llama
from lit_trainer.data.unpaired import UnpairedPreferenceDataModule
from lit_trainer.models import load_tokenizer
from lit_trainer.modules.kto import KTOModule

PROMPTS = ["12+34=", "5+5=", "99+1=", "7+80=", "3+4=", "10+10=", "1+1=", "2+3="]
COMPLETIONS = ["46", "11", "100", "78", "7", "2", "2", "6"]


def _fit(labels: list[bool], **options) -> list[str]:
    """Fit one step on rows with these labels; the messages of KTOModule's warnings."""
    rows = {"prompt": PROMPTS[: len(labels)], "completion": COMPLETIONS[: len(labels)], "label": labels}
    data = UnpairedPreferenceDataModule(
        tokenizer=load_tokenizer("tiny"), dataset=Dataset.from_dict(rows), val_size=0, max_length=32, batch_size=4
    )
    trainer = pl.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, accelerator="cpu", devices=1,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(KTOModule(tiny_llama(0), **options), datamodule=data)
    return [str(w.message) for w in record if "KTOModule:" in str(w.message)]


@pytest.mark.parametrize(
    ("labels", "counts", "missing"),
    [
        ([True] * 6, "6 desirable and 0 undesirable rows", "undesirable"),
        ([False] * 5, "0 desirable and 5", "desirable"),
    ],
    ids=["only-desirable", "only-undesirable"],
)
def test_one_kind_of_label_warns_once_with_the_counts_and_why(labels, counts, missing):
    (message,) = _fit(labels)
    assert counts in message
    assert "KL estimate" in message and "desirable_weight/undesirable_weight" in message
    assert f"Add {missing} rows" in message


def test_balanced_labels_are_silent():
    assert _fit([True, False] * 3) == []


def test_unequal_counts_warn_with_trls_ranges_unless_a_weight_balances_them():
    labels = [True, False, True, False, True, False, True, True]  # 5 desirable, 3 undesirable
    (message,) = _fit(labels)
    # by hand, TRL 1.16's bounds: desirable_weight in [3/5, 1.33 * 3/5] and undesirable_weight in [5/3 / 1.33, 5/3]
    assert "5 desirable and 3 undesirable rows" in message
    assert "desirable_weight in [0.6, 0.8]" in message and "undesirable_weight in [1.25, 1.67]" in message
    assert _fit(labels, desirable_weight=0.7) == []
    assert _fit(labels, undesirable_weight=1.5) == []
