"""``chunked_token_logps``: the same log-probs, entropies and gradients as the full-logits path, a chunk at a time."""

from __future__ import annotations

import pytest
import torch

from helpers.rounding import Rounding, relative_l2
from lit_trainer.losses.chunked import chunked_token_logps, default_chunk_size
from lit_trainer.losses.logprobs import selective_log_softmax


def full_path(hidden, weight, bias, targets, temperature):
    """The path the modules take today: whole logits, ``selective_log_softmax``, entropy from the softmax."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logps = selective_log_softmax(logits, targets, temperature)
    z = logits / temperature
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    return logps, entropy


def inputs(dtype, bias=True, seed=0, shape=(3, 7), hidden_size=16, vocab=50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=dtype) / 2
    b = torch.randn(vocab, generator=g, dtype=dtype) if bias else None
    targets = torch.randint(0, vocab, shape, generator=g)
    g_logp, g_ent = torch.randn(*shape, generator=g, dtype=dtype), torch.randn(*shape, generator=g, dtype=dtype)
    return hidden, weight, b, targets, g_logp, g_ent


def gradients(fn, hidden, weight, bias, targets, g_logp, g_ent, temperature):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    logps, entropy = fn(*leaves[:2], leaves[2] if bias is not None else None, targets, temperature)
    ((logps * g_logp).sum() + (entropy * g_ent).sum()).backward()
    return [logps.detach(), entropy.detach()] + [leaf.grad for leaf in leaves]


def chunked(chunk_size):
    def fn(hidden, weight, bias, targets, temperature):
        return chunked_token_logps(
            hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size, with_entropy=True
        )

    return fn


@pytest.mark.parametrize("chunk_size", [1, 4, 21, None])
@pytest.mark.parametrize(("temperature", "bias"), [(1.0, False), (0.7, True)])
def test_values_and_gradients_equal_the_full_logits_path(chunk_size, temperature, bias):
    args64 = inputs(torch.float64, bias)
    args32 = [a.float() if a is not None and a.is_floating_point() else a for a in args64]
    reference = gradients(full_path, *args64, temperature)  # float64: the exact values to rounding
    full32 = gradients(full_path, *args32, temperature)
    ours32 = gradients(chunked(chunk_size), *args32, temperature)
    ours64 = gradients(chunked(chunk_size), *args64, temperature)
    hidden, weight, b, targets, g_logp, g_ent = args64
    wrong = gradients(full_path, hidden, weight, b, targets.roll(1, -1), g_logp, -g_ent, temperature * 1.5)
    names = ["logps", "entropy", "grad hidden", "grad weight", "grad bias"]
    for name, ref, full, ours, ours_exact, bad in zip(names, reference, full32, ours32, ours64, wrong):
        # float64: the same formulas, so equal to float64 rounding (1e-12 relative is ~1e4 ulps of slack and still
        # 1e9 times below a wrong term); float32: within the bound calibrated on the full path's own float32 error
        assert torch.allclose(ours_exact, ref, rtol=1e-12, atol=1e-12), name
        mistake = relative_l2({name: bad}, {name: ref})  # wrong targets, temperature and entropy gradient
        Rounding.of({name: full}, {name: ref}, what=name).check({name: ours}, {name: full}, mistake=mistake)


def test_only_the_positions_given_and_shapes_kept():
    hidden, weight, _, targets, *_ = inputs(torch.float64, bias=False, shape=(2, 5))
    logps, entropy = chunked_token_logps(hidden, weight, targets, chunk_size=3)
    assert logps.shape == (2, 5) and entropy is None
    row = torch.log_softmax(hidden[1, 2] @ weight.T, -1)[targets[1, 2]]  # by hand: one position
    assert torch.allclose(logps[1, 2], row, rtol=1e-12, atol=0)


def test_no_grad_and_frozen_head():
    hidden, weight, _, targets, *_ = inputs(torch.float32, bias=False)
    with torch.no_grad():
        logps, _ = chunked_token_logps(hidden, weight, targets)
    assert not logps.requires_grad
    leaf = hidden.clone().requires_grad_()
    logps, _ = chunked_token_logps(leaf, weight, targets, chunk_size=2)  # frozen head: only the hidden gradient
    logps.sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


def test_options_are_checked_and_the_default_chunk_is_bounded():
    hidden, weight, _, targets, *_ = inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="temperature=0"):
        chunked_token_logps(hidden, weight, targets, temperature=0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_token_logps(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="do not match"):
        chunked_token_logps(hidden, weight, targets[:, :3])
    assert default_chunk_size(151_936) * 151_936 * 4 <= 64 * 2**20  # one chunk of float32 logits <= 64 MiB
    assert default_chunk_size(384) > 4096


def test_logp_sum_forms_the_same_gradients_in_the_forward_pass():
    from lit_trainer.losses.chunked import chunked_logp_sum

    hidden, weight, bias, targets, g_logp, _ = inputs(torch.float64)
    weights = (g_logp > 0).to(torch.float64)  # a 0/1 loss mask

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        total = fn(*leaves)
        (3.0 * total).backward()  # an upstream factor: the backward pass must scale the precomputed gradients
        return [total.detach()] + [leaf.grad for leaf in leaves]

    full = run(lambda h, w, b: (full_path(h, w, b, targets, 1.0)[0] * weights).sum())
    ours = run(lambda h, w, b: chunked_logp_sum(h, w, targets, weights, bias=b, chunk_size=5))
    for name, a, b in zip(["sum", "grad hidden", "grad weight", "grad bias"], ours, full):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name  # float64, same formulas (see above)
    with pytest.raises(ValueError, match="shaped like targets"):
        chunked_logp_sum(hidden, weight, targets, weights[:, :2])
