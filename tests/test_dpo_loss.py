"""Hand-computed checks of the DPO pair losses, f-divergences and helpers (TRL's DPOTrainer formulas).

See docs/design.md#trl-dpo.

Fixed batch of three pairs (float64 so plain `math` matches to 1e-12):

    π_c = [-3.0, -5.0, -2.0]   ρ_c = [-3.5, -4.0, -3.0]   ->  u_c = π_c - ρ_c = [ 0.5, -1.0,  1.0]
    π_r = [-4.0, -4.5, -6.0]   ρ_r = [-3.5, -5.0, -5.0]   ->  u_r = π_r - ρ_r = [-0.5,  0.5, -1.0]
    Δ = u_c - u_r = [1.0, -1.5, 2.0]; with β = 0.1: z = βΔ = [0.1, -0.15, 0.2]
    lengths n_c = [2, 4, 1], n_r = [5, 3, 0 -> clamped to 1]
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from lit_trainer.losses.dpo import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    DPOLossType,
    dpo_loss,
    dpo_rewards_metrics,
    sequence_logps,
)

PI_C, PI_R = [-3.0, -5.0, -2.0], [-4.0, -4.5, -6.0]
REF_C, REF_R = [-3.5, -4.0, -3.0], [-3.5, -5.0, -5.0]
N_C, N_R = [2, 4, 1], [5, 3, 0]
BETA, EPS, TAU = 0.1, 0.1, 0.05


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def tensors(dtype: torch.dtype = torch.float64, grad: bool = False) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=dtype, requires_grad=grad) for v in (PI_C, PI_R, REF_C, REF_R)]


def run(loss_type: str, **kwargs) -> torch.Tensor:
    """``dpo_loss`` on the fixed batch with β = 0.1, ε = 0.1, τ = 0.05 and the lengths, unless overridden."""
    defaults = {"beta": BETA, "label_smoothing": EPS, "discopop_tau": TAU}
    lengths = {"chosen_lengths": torch.tensor(N_C), "rejected_lengths": torch.tensor(N_R)}
    return dpo_loss(*tensors(), loss_type=loss_type, **{**defaults, **lengths, **kwargs})


def pairs() -> list[SimpleNamespace]:
    return [
        SimpleNamespace(uc=pc - rc, ur=pr - rr, z=BETA * ((pc - rc) - (pr - rr)), nc=max(nc, 1), nr=max(nr, 1))
        for pc, pr, rc, rr, nc, nr in zip(PI_C, PI_R, REF_C, REF_R, N_C, N_R)
    ]


def smoothed(d: float) -> float:  # aot's per-entry loss with ε = 0.1
    return -(1 - EPS) * logsig(BETA * d) - EPS * logsig(-BETA * d)


# Per-pair formulas written with `math` only (ε = 0.1, τ = 0.05), independent of the implementation.
FORMULAS = {
    "sigmoid": lambda q: -logsig(q.z),
    "hinge": lambda q: max(0.0, 1 - q.z),
    "ipo": lambda q: (q.uc / q.nc - q.ur / q.nr - 1 / (2 * BETA)) ** 2,
    "exo_pair": lambda q: sig(q.z) * (logsig(q.z) - math.log(1 - EPS)) + sig(-q.z) * (logsig(-q.z) - math.log(EPS)),
    "nca_pair": lambda q: -logsig(BETA * q.uc) - 0.5 * logsig(-BETA * q.uc) - 0.5 * logsig(-BETA * q.ur),
    "robust": lambda q: (-(1 - EPS) * logsig(q.z) + EPS * logsig(-q.z)) / (1 - 2 * EPS),
    "bco_pair": lambda q: -logsig(BETA * q.uc) - logsig(-BETA * q.ur),
    "sppo_hard": lambda q: (q.uc - 1 / (2 * BETA)) ** 2 + (q.ur + 1 / (2 * BETA)) ** 2,
    "apo_zero": lambda q: 1 - sig(BETA * q.uc) + sig(BETA * q.ur),
    "apo_down": lambda q: sig(BETA * q.uc) + 1 - sig(BETA * (q.uc - q.ur)),
    "discopop": lambda q: (1 - sig(q.z / TAU)) * -logsig(q.z) + sig(q.z / TAU) * math.exp(-q.z),
    "sigmoid_norm": lambda q: -logsig(BETA * (q.uc / q.nc - q.ur / q.nr)),
}

# Pair 0 by hand: u_c = 0.5, u_r = -0.5, z = 0.1, n_c = 2, n_r = 5.
# logσ(0.1) = -0.6443967, logσ(-0.1) = -0.7443967, σ(0.1) = 0.5249792, logσ(±0.05) = -0.6684596 / -0.7184596.
PAIR0 = {
    "sigmoid": 0.6443967,  # -logσ(0.1)
    "hinge": 0.9,  # relu(1 - 0.1)
    "ipo": 21.6225,  # (0.5/2 - (-0.5)/5 - 1/0.2)^2 = (0.25 + 0.1 - 5)^2 = (-4.65)^2
    "exo_pair": 0.4571892,  # 0.5249792*(-0.6443967 + 0.1053605) + 0.4750208*(-0.7443967 + 2.3025851)
    "nca_pair": 1.3619193,  # 0.6684596 + 0.5*0.7184596 + 0.5*0.6684596
    "robust": 0.6318967,  # (0.9*0.6443967 - 0.1*0.7443967) / 0.8
    "bco_pair": 1.3369193,  # -logσ(0.05) - logσ(0.05) = 2*0.6684596
    "sppo_hard": 40.5,  # (0.5 - 5)^2 + (-0.5 + 5)^2 = 20.25 + 20.25
    "apo_zero": 0.9750052,  # 1 - σ(0.05) + σ(-0.05) = 2*(1 - 0.5124974)
    "apo_down": 0.9875182,  # σ(0.05) + 1 - σ(0.1) = 0.5124974 + 0.4750208
    "discopop": 0.8737921,  # m = σ(0.1/0.05) = 0.8807971; (1-m)*0.6443967 + m*e^-0.1 (0.9048374)
    "sigmoid_norm": 0.6758003,  # -logσ(0.1*(0.25 + 0.1)) = -logσ(0.035)
}


def test_loss_type_names_match_the_reference_list() -> None:
    expected = (
        "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
        "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm",
    )  # fmt: skip
    assert DPO_LOSS_TYPES == get_args(DPOLossType) == expected
    assert set(FORMULAS) | {"aot", "aot_unpaired"} == set(DPO_LOSS_TYPES)


@pytest.mark.parametrize("loss_type", sorted(FORMULAS))
def test_pair_losses_match_hand_formulas(loss_type: str) -> None:
    got = run(loss_type)
    assert got.shape == (3,) and got.dtype == torch.float64
    expected = [FORMULAS[loss_type](q) for q in pairs()]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert got[0].item() == pytest.approx(PAIR0[loss_type], abs=1e-6)


def test_hinge_clips_at_zero() -> None:
    # β = 1: z = Δ = [1.0, -1.5, 2.0] -> relu(1 - z) = [0.0, 2.5, 0.0]
    expected = torch.tensor([0.0, 2.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(run("hinge", beta=1.0), expected)


def test_aot_sorts_both_margins_across_the_batch() -> None:
    # π_c - π_r = [1.0, -0.5, 4.0] -> sorted [-0.5, 1.0, 4.0]; ρ_c - ρ_r = [0.0, 1.0, 2.0] (already sorted)
    # d = [-0.5, 0.0, 2.0]  (pairwise Δ would be [1.0, -1.5, 2.0])
    expected = [smoothed(d) for d in (-0.5, 0.0, 2.0)]
    torch.testing.assert_close(run("aot"), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # entry 1: d = 0 -> -(0.9 + 0.1)*logσ(0) = ln 2
    assert run("aot")[1].item() == pytest.approx(math.log(2))
    # aot_unpaired: sort(u_c) = [-1.0, 0.5, 1.0], sort(u_r) = [-1.0, -0.5, 0.5] -> d = [0.0, 1.0, 0.5]
    expected = [smoothed(d) for d in (0.0, 1.0, 0.5)]
    got = run("aot_unpaired")
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_aot_is_invariant_to_batch_order() -> None:
    perm = torch.tensor([2, 0, 1])
    for loss_type in ("aot", "aot_unpaired"):
        shuffled = dpo_loss(*(t[perm] for t in tensors()), loss_type=loss_type, label_smoothing=EPS)
        torch.testing.assert_close(shuffled, dpo_loss(*tensors(), loss_type=loss_type, label_smoothing=EPS))


def test_label_smoothing() -> None:
    # robust with ε = 0 is plain sigmoid; pair 0 with ε = 0.25: (0.75*0.6443967 - 0.25*0.7443967)/0.5 = 0.5943967
    torch.testing.assert_close(run("robust", label_smoothing=0.0), run("sigmoid"))
    assert run("robust", label_smoothing=0.25)[0].item() == pytest.approx(0.5943967, abs=1e-6)
    # aot with ε = 0 on d = [-0.5, 0, 2]: -logσ(βd)
    expected = [-logsig(BETA * d) for d in (-0.5, 0.0, 2.0)]
    torch.testing.assert_close(run("aot", label_smoothing=0.0), torch.tensor(expected, dtype=torch.float64))
    # exo_pair with ε = 0.5: σ(z)(logσ(z) + ln 2) + σ(-z)(logσ(-z) + ln 2) = KL(Bern(σ(z)) || Bern(0.5)); z=0 -> 0
    zero = [torch.tensor([x], dtype=torch.float64) for x in (-1.0, -1.0, -1.0, -1.0)]
    assert dpo_loss(*zero, loss_type="exo_pair", label_smoothing=0.5).item() == pytest.approx(0.0, abs=1e-12)
    # types that do not read ε ignore it (TRL 1.16 has no cDPO smoothing on sigmoid)
    torch.testing.assert_close(run("sigmoid", label_smoothing=0.3), run("sigmoid", label_smoothing=0.0))


def test_length_normalisation_and_clamp() -> None:
    # pair 2: n_r = 0 is clamped to 1: ipo = (1.0/1 - (-1.0)/1 - 5)^2 = (-3)^2 = 9
    assert run("ipo")[2].item() == pytest.approx(9.0)
    # scaling every log-ratio and every length by 3 leaves the normalised losses unchanged
    pc, pr, rc, rr = tensors()
    for loss_type in ("ipo", "sigmoid_norm"):
        scaled = dpo_loss(
            3 * pc, 3 * pr, 3 * rc, 3 * rr, loss_type=loss_type, beta=BETA,
            chosen_lengths=3 * torch.tensor([2, 4, 1]), rejected_lengths=3 * torch.tensor([5, 3, 1]),
        )  # fmt: skip
        torch.testing.assert_close(scaled, run(loss_type))


def test_f_divergences_with_sigmoid() -> None:
    scores = {
        "reverse_kl": lambda u: u,
        "forward_kl": lambda u: 1 - math.exp(-u),
        "js_divergence": lambda u: math.log(2) + logsig(u),
        "alpha_divergence": lambda u: (math.exp(-0.5 * u) - 1) / -0.5,  # a = 0.5
    }
    for name, score in scores.items():
        got = run("sigmoid", f_divergence_type=name, f_alpha_divergence_coef=0.5)
        expected = [-logsig(BETA * (score(q.uc) - score(q.ur))) for q in pairs()]
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # pair 0, forward_kl: s_c = 1 - e^-0.5 = 0.3934693, s_r = 1 - e^0.5 = -0.6487213, Δ = 1.0421906,
    # -logσ(0.10421906) = ln(1 + e^-0.10421906) = ln(1.9010275) = 0.6423947
    assert run("sigmoid", f_divergence_type="forward_kl")[0].item() == pytest.approx(0.6423947, abs=1e-6)
    # alpha_divergence with a within 1e-6 of 1 falls back to reverse KL exactly (the formula would differ by
    # about (a-1)u²/2 = 5e-8 relative), and a = 1 itself does not divide by zero
    for coef in (1 + 1e-7, 1.0):
        reverse = run("hinge", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=coef)
        assert torch.equal(reverse, run("hinge"))
    # the f-score feeds the length-normalised losses too: ipo with js_divergence, pair 0
    q = pairs()[0]
    js_c, js_r = math.log(2) + logsig(q.uc), math.log(2) + logsig(q.ur)
    expected = (js_c / 2 - js_r / 5 - 5) ** 2
    assert run("ipo", f_divergence_type="js_divergence")[0].item() == pytest.approx(expected, rel=1e-12)


def test_alpha_divergence_exponent_clamp() -> None:
    # float32, a = 0.5, u_c = -200: (a-1)u = 100 is clamped to 80, so s_c = (e^80 - 1)/(-0.5) = -2(e^80 - 1),
    # finite in float32 (e^100 would overflow). u_r = 0 -> s_r = 0. hinge = 1 - β(s_c - s_r) = 1 + 0.2(e^80 - 1).
    pc = torch.tensor([-200.0], requires_grad=True)
    zero = torch.tensor([0.0])
    loss = dpo_loss(pc, zero, zero, zero, loss_type="hinge", f_divergence_type="alpha_divergence")
    assert torch.isfinite(loss).all()
    assert loss.item() == pytest.approx(1 + 0.2 * (math.exp(80) - 1), rel=1e-5)
    loss.sum().backward()
    assert pc.grad.item() == 0.0  # past the clamp the exponent is constant
    # float16 inputs clamp at 11: u_c = -30 -> (a-1)u = 15 -> 11; hinge = 1 + 0.2(e^11 - 1) = 11975.63 (float32)
    half = [torch.tensor([v], dtype=torch.float16) for v in (-30.0, 0.0, 0.0, 0.0)]
    loss = dpo_loss(*half, loss_type="hinge", f_divergence_type="alpha_divergence")
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(1 + 0.2 * (math.exp(11) - 1), rel=1e-5)


def test_gradients_match_hand_derivations() -> None:
    qs = pairs()
    # sigmoid: dℓ/dz = -σ(-z), z = β(π_c - ρ_c - π_r + ρ_r): dπ_c = -βσ(-z), dπ_r = dρ_c = +βσ(-z), dρ_r = -βσ(-z)
    # ipo: h = u_c/n_c - u_r/n_r - 1/(2β): dπ_c = 2h/n_c, dπ_r = -2h/n_r, dρ_c = -2h/n_c, dρ_r = 2h/n_r
    # robust: dℓ/dz = -[(1-ε)σ(-z) + εσ(z)]/(1-2ε) (d logσ(x)/dx = σ(-x)), times ±β as for sigmoid
    # sigmoid + forward_kl: s = 1 - e^-u, ds/du = e^-u: dπ_c = -βσ(-z)e^{-u_c}, dπ_r = +βσ(-z)e^{-u_r}
    fk = [SimpleNamespace(z=BETA * ((1 - math.exp(-q.uc)) - (1 - math.exp(-q.ur))), uc=q.uc, ur=q.ur) for q in qs]
    cases = {
        ("sigmoid", "reverse_kl"): [(-BETA * sig(-q.z), BETA * sig(-q.z)) for q in qs],
        ("ipo", "reverse_kl"): [
            (2 * h / q.nc, -2 * h / q.nr) for q in qs for h in [q.uc / q.nc - q.ur / q.nr - 1 / (2 * BETA)]
        ],
        ("robust", "reverse_kl"): [
            (-BETA * g, BETA * g) for q in qs for g in [((1 - EPS) * sig(-q.z) + EPS * sig(q.z)) / (1 - 2 * EPS)]
        ],
        ("sigmoid", "forward_kl"): [
            (-BETA * sig(-q.z) * math.exp(-q.uc), BETA * sig(-q.z) * math.exp(-q.ur)) for q in fk
        ],
    }
    for (loss_type, f_div), grads in cases.items():
        pc, pr, rc, rr = tensors(grad=True)
        loss = dpo_loss(
            pc, pr, rc, rr, loss_type=loss_type, beta=BETA, label_smoothing=EPS, f_divergence_type=f_div,
            chosen_lengths=torch.tensor(N_C), rejected_lengths=torch.tensor(N_R),
        )  # fmt: skip
        loss.sum().backward()
        d_c = torch.tensor([g[0] for g in grads], dtype=torch.float64)
        d_r = torch.tensor([g[1] for g in grads], dtype=torch.float64)
        torch.testing.assert_close(pc.grad, d_c, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pr.grad, d_r, rtol=1e-10, atol=1e-12)
        if f_div == "reverse_kl":  # the reference enters with the opposite sign
            torch.testing.assert_close(rc.grad, -d_c, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(rr.grad, -d_r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "exo_pair", "label_smoothing": 0.0}, "EXO needs label_smoothing > 0"),
        ({"loss_type": "ipo"}, "needs chosen_lengths and rejected_lengths"),
        ({"loss_type": "sigmoid_norm", "chosen_lengths": torch.tensor(N_C)}, "needs chosen_lengths"),
        ({"loss_type": "nca_pair", "f_divergence_type": "forward_kl"}, "only supported by"),
        ({"loss_type": "sft"}, "'sft' is a token-level loss"),
        ({"loss_type": "dpo"}, "loss_type='dpo'.*choose one of"),
        ({"f_divergence_type": "kl"}, "f_divergence_type='kl'.*choose one of"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 1.0}, r"must be in \[0, 1\)"),
        ({"label_smoothing": -0.1}, r"must be in \[0, 1\)"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, r"1 - 2\*label_smoothing"),
        ({"loss_type": "discopop", "discopop_tau": 0.0}, "discopop_tau must be > 0"),
        ({"loss_type": "ipo", "chosen_lengths": torch.tensor([1, 2]), "rejected_lengths": torch.tensor(N_R)},
         r"chosen_lengths=...\)` has shape \(2,\)"),
    ],
)  # fmt: skip
def test_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dpo_loss(*tensors(), **kwargs)


def test_f_divergence_support_list_and_shape_errors() -> None:
    for loss_type in DPO_LOSS_TYPES:
        kwargs = {"loss_type": loss_type, "f_divergence_type": "js_divergence", "label_smoothing": EPS}
        if loss_type in F_DIVERGENCE_LOSS_TYPES:
            assert torch.isfinite(run(**kwargs)).all()
        else:
            with pytest.raises(ValueError, match="only supported by"):
                run(**kwargs)
    pc, pr, rc, rr = tensors()
    with pytest.raises(ValueError, match="same shape"):
        dpo_loss(pc, pr[:2], rc, rr)
    with pytest.raises(ValueError, match="1-D"):
        dpo_loss(pc[None], pr[None], rc[None], rr[None])


def test_rewards_metrics() -> None:
    pc, pr, rc, rr = tensors(grad=True)
    m = dpo_rewards_metrics(pc, pr, rc, rr, beta=BETA)
    # βu_c = [0.05, -0.1, 0.1] -> mean 0.05/3; βu_r = [-0.05, 0.05, -0.1] -> mean -0.1/3
    assert m["rewards/chosen"].item() == pytest.approx(0.05 / 3)
    assert m["rewards/rejected"].item() == pytest.approx(-0.1 / 3)
    assert m["rewards/accuracies"].item() == pytest.approx(2 / 3)  # 0.05 > -0.05, -0.1 < 0.05, 0.1 > -0.1
    assert m["rewards/margins"].item() == pytest.approx(0.15 / 3)  # β mean(Δ) = 0.1*(1 - 1.5 + 2)/3
    assert m["logps/chosen"].item() == pytest.approx(-10 / 3)  # (-3 - 5 - 2)/3
    assert m["logps/rejected"].item() == pytest.approx(-14.5 / 3)  # (-4 - 4.5 - 6)/3
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    # ties are not correct: strict comparison
    tie = [torch.tensor([-1.0, -2.0])] * 4
    assert dpo_rewards_metrics(*tie, beta=0.5)["rewards/accuracies"].item() == 0.0


def test_sequence_logps_plain_and_ld() -> None:
    nan = float("nan")
    # B = 2 pairs -> rows: chosen0, chosen1, rejected0, rejected1; column 0 is prompt (masked); NaN where masked
    logps = torch.tensor(
        [
            [nan, -1.0, -2.0, -3.0, nan],  # chosen0, 3 tokens
            [nan, -0.5, nan, nan, nan],  # chosen1, 1 token
            [nan, -4.0, -1.0, nan, nan],  # rejected0, 2 tokens
            [nan, -1.0, -1.0, -2.0, -2.0],  # rejected1, 4 tokens
        ]
    )
    mask = ~logps.isnan()
    torch.testing.assert_close(sequence_logps(logps, mask), torch.tensor([-6.0, -0.5, -5.0, -6.0]))
    # LD-DPO, α = 0.25: pair 0 shares min(3, 2) = 2 tokens, pair 1 min(1, 4) = 1
    # chosen0 = -1 - 2 + 0.25*(-3) = -3.75; chosen1 = -0.5; rejected0 = -4 - 1 = -5
    # rejected1 = -1 + 0.25*(-1 - 2 - 2) = -2.25
    got = sequence_logps(logps, mask.int(), ld_alpha=0.25)
    torch.testing.assert_close(got, torch.tensor([-3.75, -0.5, -5.0, -2.25]))
    # ld_alpha = 1 is the plain sum
    torch.testing.assert_close(sequence_logps(logps, mask, ld_alpha=1.0), sequence_logps(logps, mask))
    with pytest.raises(ValueError, match="odd"):
        sequence_logps(logps[:3], mask[:3], ld_alpha=0.5)
    with pytest.raises(ValueError, match="same shape"):
        sequence_logps(logps, mask[:, :3])
