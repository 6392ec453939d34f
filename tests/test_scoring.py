"""The one scoring function of the preference modules (:func:`lit_trainer.modules.scoring.score_rows`), checked by
hand on a model whose logits are known, and CPO/ORPO training on preference rows with images through it."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lit_trainer.data import builtin_shapes
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.modules import CPOModule, ORPOModule
from lit_trainer.modules.base._logits import score_tokens
from lit_trainer.modules.scoring import score_rows

LSE = math.log(1 + math.e + math.e**2)  # log Σ_v exp(v) over the vocabulary {0, 1, 2}


class _FixedLogits(torch.nn.Module):
    """Logits ``[0, 1, 2]`` at every position: ``log p(v) = v - LSE`` whatever the input."""

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        return SimpleNamespace(logits=torch.arange(3.0).expand(*input_ids.shape, 3))


# row 0: prompt [1, 0], completion [2, 1]; row 1: prompt [1, 0], completion [2], one pad
BATCH = {
    "input_ids": torch.tensor([[1, 0, 2, 1], [1, 0, 2, 0]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
    "completion_mask": torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]]),
}
FULL = functools.partial(score_tokens, chunked=False)


def test_score_rows_sums_the_completion_log_probs_by_hand():
    scores = score_rows(FULL, _FixedLogits(), BATCH, stats=True)
    # row 0: log p(2) + log p(1) = (2 - LSE) + (1 - LSE); row 1: log p(2)
    torch.testing.assert_close(scores.seq, torch.tensor([3 - 2 * LSE, 2 - LSE]))
    assert scores.mask.tolist() == [[False, True, True], [False, True, False]]  # position t predicts token t + 1
    assert scores.completion.tolist() == scores.mask.tolist() and scores.tokens.tolist() == [2, 1]
    torch.testing.assert_close(scores.logits_mean, torch.ones(2, 3))  # mean of [0, 1, 2]


def test_score_rows_averages_weights_and_scores_the_prompt_by_hand():
    averaged = score_rows(FULL, _FixedLogits(), BATCH, averaged=True).seq
    torch.testing.assert_close(averaged, torch.tensor([(3 - 2 * LSE) / 2, 2 - LSE]))
    # LD-DPO: the chosen row's tokens past the shorter (rejected) completion's 1 token count 0.5
    weighted = score_rows(FULL, _FixedLogits(), BATCH, ld_alpha=0.5).seq
    torch.testing.assert_close(weighted, torch.tensor([(2 - LSE) + 0.5 * (1 - LSE), 2 - LSE]))
    # every real token a target: the prompt's token 0 too, but `seq` still sums the completion only
    everything = score_rows(FULL, _FixedLogits(), BATCH, targets="all")
    assert everything.mask.tolist() == [[True, True, True], [True, True, False]]
    torch.testing.assert_close(everything.token_logps.sum(-1), torch.tensor([3 - 3 * LSE, 2 - 2 * LSE]))
    torch.testing.assert_close(everything.seq, torch.tensor([3 - 2 * LSE, 2 - LSE]))


def test_score_rows_reads_prefixed_rows():
    partner = {"KL_" + key: value.flip(0) for key, value in BATCH.items()}
    scores = score_rows(FULL, _FixedLogits(), {**BATCH, **partner}, prefix="KL_")
    torch.testing.assert_close(scores.seq, torch.tensor([2 - LSE, 3 - 2 * LSE]))


@pytest.mark.slow  # ~3 s: two CPO steps and a validation pass of tiny-vl
@pytest.mark.parametrize(
    "make", [lambda: CPOModule("tiny-vl", learning_rate=1e-3), lambda: ORPOModule("tiny-vl", nll_on_prompt=False)]
)
def test_reference_free_modules_train_on_image_preference_rows(make):
    rows = builtin_shapes.preference_rows("train").select(range(8))
    dm = PreferenceDataModule(
        tokenizer="tiny-vl", dataset=rows, validation_dataset=rows.select(range(4)), batch_size=4, max_length=64
    )
    torch.manual_seed(0)
    module = make()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=2, limit_val_batches=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])}
    assert not any("vision_tower" in n for n in changed)  # frozen by default
    assert any("multi_modal_projector" in n for n in changed) and any("language_model" in n for n in changed)


def test_orpo_scoring_the_prompt_still_refuses_images():
    batch = {**BATCH, "pixel_values": torch.zeros(1, 3, 8, 8)}
    with pytest.raises(ValueError, match="its NLL term covers the prompt"):
        ORPOModule("tiny").score(None, batch)
