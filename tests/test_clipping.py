"""Gradient clipping with the norm summed in float64 (``lit_trainer.modules.base._clipping``): the norm does not depend
on how the gradients are split (whole tensors, FSDP2 shards, chunks), and clipping is torch's rule. The sharded
(DTensor) path runs in ``tests/test_fsdp.py`` (GRPO sharded equals DDP bit for bit without accumulation)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_trainer.modules.base import _clipping

# float64 sums of the same float32 squares in other orders and groupings differ by ~n * 2**-53 relative at most; for
# these ~2e4 values that is ~2e-12: a wrong norm (a missed tensor, a float32 sum) is off by >= 1e-7
FLOAT64_ORDER = 1e-11


def _grads(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in ((384, 32), (32,), (64, 32)):
        param = torch.nn.Parameter(torch.zeros(shape))
        param.grad = torch.randn(shape, generator=generator) * 0.3
        params.append(param)
    return params


def _exact_norm(params: list[torch.nn.Parameter]) -> float:
    return float(torch.cat([p.grad.double().flatten() for p in params]).norm())


def test_norm_is_the_float64_norm_whatever_the_split(monkeypatch: pytest.MonkeyPatch):
    params = _grads()
    exact = _exact_norm(params)
    whole = float(_clipping.total_norm([p.grad for p in params]))
    halves = float(_clipping.total_norm([h for p in params for h in p.grad.chunk(2)]))  # as two shards would hold it
    monkeypatch.setattr(_clipping, "CHUNK", 1000)  # several float64 chunks per tensor
    chunked = float(_clipping.total_norm([p.grad for p in params]))
    for value in (whole, halves, chunked):
        assert value == pytest.approx(exact, rel=FLOAT64_ORDER)


def test_clipping_scales_to_max_norm_and_leaves_small_or_measured_gradients_alone():
    params = _grads()
    before = _exact_norm(params)
    norm = _clipping.clip_grad_norm(params, 1.0)
    # returned in float32 for logging: one rounding of the float64 norm (2**-24 relative)
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(before, rel=2**-24)
    assert before > 1.0
    # torch's rule: g * max_norm / (norm + 1e-6); the float32 products round each element (2**-24 relative)
    assert _exact_norm(params) == pytest.approx(1.0 * before / (before + 1e-6), rel=2**-23)
    clipped = [p.grad.clone() for p in params]
    _clipping.clip_grad_norm(params, 10.0)  # below the bound now: unchanged (multiplied by exactly 1)
    _clipping.clip_grad_norm(params, math.inf)  # measure only
    assert all(torch.equal(p.grad, c) for p, c in zip(params, clipped, strict=True))


def test_clipping_matches_torch_up_to_its_float32_norm():
    ours, theirs = _grads(), _grads()
    _clipping.clip_grad_norm(ours, 0.5)
    torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    for a, b in zip(ours, theirs, strict=True):
        # the only difference is torch's float32 norm (summed in float32: ~sqrt(n) * 2**-24 relative, here ~1e-5
        # at most), which moves every element by the same factor; a wrong rule would be off by O(1)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=0)
