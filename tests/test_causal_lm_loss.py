import math

import torch

from helpers.rounding import FLOAT32_UNIT, MARGIN
from lit_trainer.losses import causal_lm_loss
from lit_trainer.losses.causal_lm import count_target_tokens


def test_hand_computed_loss_with_shift_and_ignore_index():
    # one row, T=3, V=2. Targets after the shift: labels[1]=1 (predicted from logits[0]), labels[2]=-100 (ignored).
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0], [1.0, 2.0]]])
    labels = torch.tensor([[-100, 1, -100]])
    # p(1 | logits[0]) = 3 / (1 + 3) = 0.75 -> loss = -log(0.75)
    # tolerance (isclose's rtol 1e-5): a float32 log-softmax of hand values against the float64 formula
    assert torch.isclose(causal_lm_loss(logits, labels), torch.tensor(-math.log(0.75)))
    assert int(count_target_tokens(labels)) == 1
    # normalised by a window count of 4 instead of the local 1
    assert torch.isclose(causal_lm_loss(logits, labels, num_items_in_batch=4), torch.tensor(-math.log(0.75) / 4))


def test_sum_over_microbatches_equals_full_batch_mean():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)
    labels = torch.randint(0, 11, (4, 6))
    labels[0, 3:] = -100
    labels[2, :5] = -100
    total = count_target_tokens(labels)
    parts = sum(causal_lm_loss(logits[i : i + 1], labels[i : i + 1], total) for i in range(4))
    full = causal_lm_loss(logits, labels)
    # tolerance derived, not guessed: both are float32 sums of N positive token losses (condition number 1), so each
    # is within (N + 5) float32 units of the exact value (N - 1 additions, at most 4 partial sums, 1 division, the
    # log-softmax's own rounding); two such values differ by at most twice that. One scalar's float64 twin would be
    # a lottery of a single rounding, so helpers/rounding.py's measurement is not used here.
    n = int(total)
    bound = 2 * (n + 5) * FLOAT32_UNIT
    means = sum(causal_lm_loss(logits[i : i + 1], labels[i : i + 1]) for i in range(4)) / 4
    mistake = abs(float(means / full) - 1)  # the mean of the per-row means (each row's own count)
    assert bound * MARGIN <= mistake
    assert abs(float(parts / full) - 1) <= bound


def test_no_target_gives_zero_not_nan():
    logits = torch.randn(1, 4, 5)
    labels = torch.full((1, 4), -100)
    assert causal_lm_loss(logits, labels).item() == 0.0


def test_float64_logits_stay_float64():
    """A float64 run is the float64 twin the calibrated tolerances measure against (``tests/helpers/rounding.py``):
    the loss and the log-probs keep float64 rather than rounding through float32."""
    from lit_trainer.losses.logprobs import selective_log_softmax

    logits, labels = torch.randn(2, 5, 7, dtype=torch.float64), torch.randint(0, 7, (2, 5))
    assert causal_lm_loss(logits, labels).dtype == torch.float64
    assert causal_lm_loss(logits.half(), labels).dtype == torch.float32  # low precision is still upcast
    assert selective_log_softmax(logits, labels).dtype == torch.float64
    assert selective_log_softmax(logits.bfloat16(), labels).dtype == torch.float32
