import math

import torch

from lit_trainer.losses import causal_lm_loss
from lit_trainer.losses.causal_lm import count_target_tokens


def test_hand_computed_loss_with_shift_and_ignore_index():
    # one row, T=3, V=2. Targets after the shift: labels[1]=1 (predicted from logits[0]), labels[2]=-100 (ignored).
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0], [1.0, 2.0]]])
    labels = torch.tensor([[-100, 1, -100]])
    # p(1 | logits[0]) = 3 / (1 + 3) = 0.75 -> loss = -log(0.75)
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
    assert torch.allclose(parts, causal_lm_loss(logits, labels), atol=1e-6)


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
