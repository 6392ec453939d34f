"""grpo_advantages, grpo_reward_metrics, grpo_policy_loss and grpo_loss_metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lit_trainer.losses.grpo import grpo_loss_metrics, grpo_policy_loss
from lit_trainer.losses.grpo_advantages import grpo_advantages, grpo_reward_metrics

NAN = float("nan")


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    # tolerance: float32 results against hand values computed in float64: float32 rounding of values of order 1-10
    # is below 1e-6; callers pass atol=1e-4 where the reference values were printed to 4 decimals
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------------- advantages
# A worked example of TRL's group-relative advantages, G = 4: groups [1, 0, .5, .5] | [2, 2, 2, 2] | [0, 4, 1, 2].
REF_REWARDS = torch.tensor([1, 0, 0.5, 0.5, 2, 2, 2, 2, 0, 4, 1, 2])


def test_reference_example_none() -> None:
    # group means 0.5 | 2 | 1.75 -> r - mean
    expected = [0.5, -0.5, 0, 0, 0, 0, 0, 0, -1.75, 2.25, -0.75, 0.25]
    close(grpo_advantages(REF_REWARDS, 4, scale_rewards="none"), expected)


def test_reference_example_group() -> None:
    # group 0: SS = .25+.25 = .5, std = sqrt(.5/3) = 0.408248; group 1: std 0 -> 0/(0+1e-4) = 0
    # group 2: SS = 1.75^2+2.25^2+.75^2+.25^2 = 8.75, std = sqrt(8.75/3) = 1.707825
    s0, s2 = math.sqrt(0.5 / 3) + 1e-4, math.sqrt(8.75 / 3) + 1e-4
    expected = [0.5 / s0, -0.5 / s0, 0, 0, 0, 0, 0, 0, -1.75 / s2, 2.25 / s2, -0.75 / s2, 0.25 / s2]
    adv = grpo_advantages(REF_REWARDS, 4, scale_rewards="group")
    close(adv, expected)
    close(adv, [1.2244, -1.2244, 0, 0, 0, 0, 0, 0, -1.0246, 1.3174, -0.4391, 0.1464], atol=1e-4)  # reference print


def test_reference_example_batch() -> None:
    # batch mean 17/12; SS = sum (x - 17/12)^2 = 14.416667, std = sqrt(14.416667/11) = 1.144817
    # still centred on the GROUP mean, divided by the batch std
    mean = 17 / 12
    ss = sum((x - mean) ** 2 for x in REF_REWARDS.tolist())
    assert ss == pytest.approx(14.416667, abs=1e-6)
    s = math.sqrt(ss / 11) + 1e-4
    expected = [0.5 / s, -0.5 / s, 0, 0, 0, 0, 0, 0, -1.75 / s, 2.25 / s, -0.75 / s, 0.25 / s]
    adv = grpo_advantages(REF_REWARDS, 4, scale_rewards="batch")
    close(adv, expected)
    close(adv, [0.4367, -0.4367, 0, 0, 0, 0, 0, 0, -1.5285, 1.9652, -0.6551, 0.2184], atol=1e-4)


# Two reward functions with NaN (= unscored), weights [1, 2], G = 3:
# rows   R0   R1    r = nansum(w R)
#  0      1   NaN   1
#  1      0   1     0 + 2 = 2
#  2    NaN   NaN   NaN (unscorable)
#  3      2   1     2 + 2 = 4
#  4      0   NaN   0
#  5      1   1     1 + 2 = 3
NAN_REWARDS = torch.tensor([[1, NAN], [0, 1], [NAN, NAN], [2, 1], [0, NAN], [1, 1]])


def test_nan_rewards_group() -> None:
    # group 0 r = [1, 2, NaN]: mean 1.5, std = sqrt((.25+.25)/1) = sqrt(.5); row 2 -> NaN -> 0
    # group 1 r = [4, 0, 3]: mean 7/3, devs [5/3, -7/3, 2/3], SS = (25+49+4)/9 = 26/3, std = sqrt(13/3)
    s0, s1 = math.sqrt(0.5) + 1e-4, math.sqrt(13 / 3) + 1e-4
    expected = [-0.5 / s0, 0.5 / s0, 0, (5 / 3) / s1, (-7 / 3) / s1, (2 / 3) / s1]
    close(grpo_advantages(NAN_REWARDS, 3, reward_weights=[1.0, 2.0]), expected)


def test_nan_rewards_batch() -> None:
    # valid r = [1, 2, 4, 0, 3]: mean 2, SS = 1+0+4+4+1 = 10, std = sqrt(10/4); numerators as in the group case
    s = math.sqrt(2.5) + 1e-4
    expected = [-0.5 / s, 0.5 / s, 0, (5 / 3) / s, (-7 / 3) / s, (2 / 3) / s]
    adv = grpo_advantages(NAN_REWARDS, 3, reward_weights=torch.tensor([1.0, 2.0]), scale_rewards="batch")
    close(adv, expected)


def test_normalize_then_sum() -> None:
    # per function, per group z = (R - mean) / (std + 1e-4):
    #   R0 g0 [1, 0, NaN]: mean .5, std sqrt(.5) -> [a, -a, NaN] with a = .5 / (sqrt(.5) + 1e-4)
    #   R1 g0 [NaN, 1, NaN]: std NaN -> all NaN
    #   R0 g1 [2, 0, 1]: mean 1, std 1 -> [c, -c, 0] with c = 1 / (1 + 1e-4)
    #   R1 g1 [1, NaN, 1]: std 0 -> [0, NaN, 0]
    # r = nansum(w z) = [a, -a, NaN(unscorable), c, -c, 0]; batch mean 0, SS = 2a^2 + 2c^2 over 5 values
    a, c = 0.5 / (math.sqrt(0.5) + 1e-4), 1 / (1 + 1e-4)
    s = math.sqrt((2 * a * a + 2 * c * c) / 4) + 1e-4
    expected = [a / s, -a / s, 0, c / s, -c / s, 0]
    for scale in ("group", "batch", "none"):  # scale_rewards is ignored by GDPO
        adv = grpo_advantages(
            NAN_REWARDS, 3, reward_weights=[1.0, 2.0], scale_rewards=scale, aggregation="normalize_then_sum"
        )
        close(adv, expected)


def test_single_valid_value_and_all_nan_group_get_zero() -> None:
    # group 0: one valid value -> std NaN -> 0; group 1 all NaN -> 0
    adv = grpo_advantages(torch.tensor([3.0, NAN, NAN, NAN]), 2)
    close(adv, [0, 0, 0, 0])


def test_reward_metrics_reference_example() -> None:
    m = grpo_reward_metrics(REF_REWARDS, 4, reward_names=["acc"])
    close(m["reward"], 17 / 12)
    close(m["reward_std"], math.sqrt(14.416667 / 11), atol=1e-6)
    close(m["rewards/acc/mean"], 17 / 12)
    close(m["frac_reward_zero_std"], 4 / 12)  # only group 1 (4 rows) has std 0
    close(grpo_reward_metrics(REF_REWARDS, 4, scale_rewards="batch")["frac_reward_zero_std"], 0.0)
    close(grpo_reward_metrics(torch.full((4,), 2.0), 2, scale_rewards="batch")["frac_reward_zero_std"], 1.0)


def test_reward_metrics_with_nan() -> None:
    m = grpo_reward_metrics(NAN_REWARDS, 3, reward_weights=[1.0, 2.0], reward_names=["a", "b"])
    # a: [1, 0, 2, 0, 1] -> mean .8, devs [.2, -.8, 1.2, -.8, .2], SS = 2.8, std = sqrt(2.8/4)
    close(m["rewards/a/mean"], 0.8)
    close(m["rewards/a/std"], math.sqrt(0.7))
    close(m["rewards/b/mean"], 1.0)  # [1, 1, 1]
    close(m["rewards/b/std"], 0.0)
    close(m["reward"], 2.0)  # r valid = [1, 2, 4, 0, 3] -> 10 / 5
    close(m["reward_std"], math.sqrt(2.5))
    close(m["frac_reward_zero_std"], 0.0)
    # a group with a single valid value has a NaN sigma, which counts as non-zero
    close(grpo_reward_metrics(torch.tensor([1.0, NAN, 2.0, 2.0]), 2)["frac_reward_zero_std"], 0.5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale_rewards": "std"}, "scale_rewards='std'"),
        ({"aggregation": "mean"}, "aggregation='mean'"),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
    ],
)
def test_advantage_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_advantages(REF_REWARDS, 4, **kwargs)


def test_advantage_rows_must_be_multiple_of_g() -> None:
    with pytest.raises(ValueError, match="num_generations=5"):
        grpo_advantages(REF_REWARDS, 5)


# --------------------------------------------------------------------------------------------------- the loss
# B = 2 rows, T = 3, old = -1 everywhere, logps = old + log(ratio), so ratio r is exact by construction.
# row 0: A = +1, r = [1.5, 1.0, 0.7], mask [1, 1, 1]
# row 1: A = -1, r = [0.5, 1.1, pad], mask [1, 1, 0]  (pad logp 0 -> r = e, must be ignored)
# eps = 0.2 -> clip range [0.8, 1.2]. Per-token L = -min(r A, clip(r) A):
# row 0: -min(1.5, 1.2) = -1.2 | -1.0 | -min(.7, .8) = -0.7        sum -2.9, mean -2.9/3
# row 1: max(.5, .8) = 0.8     | max(1.1, 1.1) = 1.1              sum  1.9, mean  0.95
RATIOS = [[1.5, 1.0, 0.7], [0.5, 1.1, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -1.0])


def make_logps() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logps = old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    logps[1, 2] = 0.0
    return logps.requires_grad_(), old


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        ("grpo", {}, (-2.9 / 3 + 1.9 / 2) / 2),  # mean of per-row means
        ("bnpo", {}, (-2.9 + 1.9) / 5),  # masked sum / 5 tokens
        ("dr_grpo", {"max_completion_length": 4}, (-2.9 + 1.9) / (2 * 4)),  # / (B * max_len)
        ("dapo", {"num_items_in_batch": 10}, (-2.9 + 1.9) / 10),
        ("dapo", {"num_items_in_batch": torch.tensor(10)}, (-2.9 + 1.9) / 10),
        ("dapo", {}, (-2.9 + 1.9) / 5),  # no normaliser: local token count
        ("luspo", {}, (-2.9 + 1.9) / 2),  # mean over rows of per-row sums
        # clip-higher, range [0.8, 1.6]: row 0 token 0 becomes -1.5 -> (-3.2 + 1.9) / 5
        ("dapo", {"epsilon_high": 0.6}, (-3.2 + 1.9) / 5),
    ],
)
def test_clipped_loss_values(loss_type: str, kwargs: dict, expected: float) -> None:
    logps, old = make_logps()
    loss = grpo_policy_loss(logps, old, ADV, MASK, loss_type=loss_type, **kwargs)
    close(loss, expected)


def test_clipped_gradient_matches_hand_formula() -> None:
    # dL/dlogp = dL/dr * r. Active (unclipped) tokens give -A r; clipped ones (r > 1+eps & A > 0, or
    # r < 1-eps & A < 0) give 0. row 0: [0 (1.5 clipped), -1.0, -0.7]; row 1: [0 (0.5 clipped), +1.1, 0 (pad)].
    logps, old = make_logps()
    grpo_policy_loss(logps, old, ADV, MASK, loss_type="dapo", num_items_in_batch=10).backward()
    close(logps.grad, [[0, -1.0 / 10, -0.7 / 10], [0, 1.1 / 10, 0]])
    # grpo: row 0 divided by (3 tokens * 2 rows), row 1 by (2 tokens * 2 rows)
    logps, old = make_logps()
    grpo_policy_loss(logps, old, ADV, MASK, loss_type="grpo").backward()
    close(logps.grad, [[0, -1.0 / 6, -0.7 / 6], [0, 1.1 / 4, 0]])


def test_delta_caps_the_unclipped_branch() -> None:
    # one row, A = -1, r = [2.0, 1.25], eps = .2, delta = 1.3:
    # token 0: -min(min(2, 1.3) * -1, 1.2 * -1) = 1.3 (without delta: 2.0); token 1: -min(-1.25, -1.2) = 1.25
    old = torch.zeros(1, 2, dtype=torch.float64)
    logps = torch.log(torch.tensor([[2.0, 1.25]], dtype=torch.float64)).requires_grad_()
    mask, adv = torch.ones(1, 2), torch.tensor([-1.0])
    loss = grpo_policy_loss(logps, old, adv, mask, loss_type="bnpo", delta=1.3)
    close(loss, (1.3 + 1.25) / 2)
    loss.backward()
    close(logps.grad, [[0.0, 1.25 / 2]])  # the capped token has no gradient; token 1: -A r / 2
    close(grpo_policy_loss(logps, old, adv, mask, loss_type="bnpo"), (2.0 + 1.25) / 2)


def test_cispo() -> None:
    # eps_high = 1.2: caps = min(r, 1.2) -> row 0 [1.2, 1.0, 0.7], row 1 [0.5, 1.1]; L = -cap * A * logp
    logps, old = make_logps()
    lp = [[-1 + math.log(1.5), -1.0, -1 + math.log(0.7)], [-1 + math.log(0.5), -1 + math.log(1.1)]]
    total = -(1.2 * lp[0][0] + 1.0 * lp[0][1] + 0.7 * lp[0][2]) + (0.5 * lp[1][0] + 1.1 * lp[1][1])
    loss = grpo_policy_loss(logps, old, ADV, MASK, loss_type="cispo", epsilon_high=1.2)
    close(loss, total / 5)
    loss.backward()  # the cap is detached: dL/dlogp = -cap * A / 5
    close(logps.grad, [[-1.2 / 5, -1.0 / 5, -0.7 / 5], [0.5 / 5, 1.1 / 5, 0]])
    # default eps_high = epsilon = 0.2 caps at 0.2 itself (not 1.2): every cap is 0.2
    total_02 = -0.2 * sum(lp[0]) + 0.2 * sum(lp[1])
    close(grpo_policy_loss(logps, old, ADV, MASK, loss_type="cispo"), total_02 / 5)


def test_sapo() -> None:
    # L = -(4/tau) sigmoid(tau (r - 1)) A; tau = 1.0 for A > 0, 1.05 for A <= 0; aggregated like grpo
    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    row0 = [-4 * sig(r - 1) for r in (1.5, 1.0, 0.7)]
    row1 = [(4 / 1.05) * sig(1.05 * (r - 1)) for r in (0.5, 1.1)]
    logps, old = make_logps()
    close(grpo_policy_loss(logps, old, ADV, MASK, loss_type="sapo"), (sum(row0) / 3 + sum(row1) / 2) / 2)
    # on-policy, r = 1: dL/dlogp = -(4/tau) tau sigmoid'(0) A = -A, divided by (row tokens * rows)
    logps, _ = make_logps()
    grpo_policy_loss(logps, None, ADV, MASK, loss_type="sapo").backward()
    close(logps.grad, [[-1 / 6, -1 / 6, -1 / 6], [1 / 4, 1 / 4, 0]])
    custom = grpo_policy_loss(logps, None, ADV, MASK, loss_type="sapo", sapo_temperature_neg=2.0)
    # on-policy r = 1: L = -(4/tau) * 0.5 * A -> row 0: -2, row 1: +(4/2) * .5 = 1
    close(custom, (-2.0 + 1.0) / 2)


def test_on_policy_default_is_dapo_ratio_one_with_gradient() -> None:
    # old = None -> r = 1 with grad; dapo local mean: L = -A -> (-3 + 2) / 5; grad -A r / 5
    logps, _ = make_logps()
    loss = grpo_policy_loss(logps, None, ADV, MASK)
    close(loss, (-3.0 + 2.0) / 5)
    loss.backward()
    close(logps.grad, [[-0.2, -0.2, -0.2], [0.2, 0.2, 0]])


def test_sequence_level_importance_sampling() -> None:
    # row 0: log w = (ln 1.5 + 0 + ln .7) / 3 -> w = 1.05^(1/3) = 1.016396 (inside [.8, 1.2]) -> L = -w per token
    # row 1: log w = (ln .5 + ln 1.1) / 2 -> w = sqrt(.55) = .741620 -> clipped to .8, A < 0 -> L = .8, no grad
    w0 = 1.05 ** (1 / 3)
    logps, old = make_logps()
    loss = grpo_policy_loss(logps, old, ADV, MASK, loss_type="bnpo", importance_sampling_level="sequence")
    close(loss, (3 * -w0 + 2 * 0.8) / 5)
    loss.backward()
    # loss = -(3/5) w0 + const; dw0/dlogp_t = w0 / 3 for each of row 0's tokens
    close(logps.grad, [[-w0 / 5] * 3, [0, 0, 0]])


# KL: one row, logps = [-1, -2], ref = [-1.5, -1], A = 0 so only the KL term remains.
# d = ref - logp = [-.5, 1]; k3 = e^d - d - 1 = [e^-.5 - .5, e - 2]
KL_LOGPS, KL_REF = [[-1.0, -2.0]], [[-1.5, -1.0]]


def test_kl_on_policy_value_and_gradient() -> None:
    k = [math.exp(-0.5) - 0.5, math.e - 2]
    for bias_correction, grads in [
        # corrected: d/dl [k r] = r (k + 1 - e^d) = r (-d) = l - ref at r = 1 -> .5, -1 (the reverse-KL gradient)
        (True, [0.1 * 0.5 / 2, 0.1 * -1.0 / 2]),
        # uncorrected: dk/dl = 1 - e^d
        (False, [0.1 * (1 - math.exp(-0.5)) / 2, 0.1 * (1 - math.e) / 2]),
    ]:
        logps = torch.tensor(KL_LOGPS, dtype=torch.float64, requires_grad=True)
        loss = grpo_policy_loss(
            logps, None, torch.zeros(1), torch.ones(1, 2), loss_type="bnpo", beta=0.1,
            ref_logps=torch.tensor(KL_REF, dtype=torch.float64), use_bias_correction_kl=bias_correction,
        )  # fmt: skip
        close(loss, 0.1 * sum(k) / 2)
        loss.backward()
        close(logps.grad, [grads])


def test_kl_bias_correction_uses_per_token_ratio_at_sequence_level() -> None:
    # Off-policy; the KL gradient at sequence level must equal the token-level one: beta r_t (l_t - ref_t) / n.
    # The reference (TRL 1.16) broadcasts the (B, 1) sequence ratio instead: shown to differ below.
    logps = torch.tensor(KL_LOGPS, dtype=torch.float64)
    ref = torch.tensor(KL_REF, dtype=torch.float64)
    old = torch.tensor([[-1.2, -1.5]], dtype=torch.float64)
    r = torch.exp(logps - old)
    expected = 0.1 * r * (logps - ref) / 2

    def kl_grad(level: str) -> torch.Tensor:
        grads = []
        for beta in (0.1, 0.0):
            lp = logps.clone().requires_grad_()
            grpo_policy_loss(
                lp, old, torch.zeros(1), torch.ones(1, 2), loss_type="bnpo", beta=beta, ref_logps=ref,
                importance_sampling_level=level,
            ).backward()  # fmt: skip
            grads.append(lp.grad)
        return grads[0] - grads[1]

    close(kl_grad("token"), expected)
    close(kl_grad("sequence"), expected)
    # independent implementation of the reference's broadcast, to show the fix changes something
    lp = logps.clone().requires_grad_()
    diff = ref - lp
    seq_ratio = torch.exp((lp - old).mean(-1, keepdim=True))
    (0.1 * ((torch.exp(diff) - diff - 1) * seq_ratio).sum() / 2).backward()
    assert (lp.grad - expected).abs().max() > 1e-3


def test_padding_values_never_leak() -> None:
    # an -inf old logp / NaN ref logp at the padded position must not change the loss, the grad or the metrics
    for level in ("token", "sequence"):
        kwargs = {"loss_type": "bnpo", "beta": 0.1, "importance_sampling_level": level}
        logps, old = make_logps()
        ref = old.clone()
        clean = grpo_policy_loss(logps, old, ADV, MASK, ref_logps=ref, **kwargs)
        clean.backward()
        clean_grad = logps.grad.clone()
        clean_metrics = grpo_loss_metrics(logps, old, ADV, MASK, ref_logps=ref, **kwargs)
        logps, old = make_logps()
        old[1, 2], ref[1, 2] = -math.inf, math.nan
        dirty = grpo_policy_loss(logps, old, ADV, MASK, ref_logps=ref, **kwargs)
        dirty.backward()
        close(dirty, clean.item())
        close(logps.grad[:, :2], clean_grad[:, :2])
        for key, value in grpo_loss_metrics(logps, old, ADV, MASK, ref_logps=ref, **kwargs).items():
            close(value, clean_metrics[key].item())


# ------------------------------------------------------------------------------------------------ metrics
def test_clip_metrics() -> None:
    # low: r < .8 & A < 0 -> row 1 token 0; high: r > 1.2 & A > 0 -> row 0 token 0; 5 masked tokens
    # (row 0's r = .7 < .8 has A > 0, so it is not low-clipped). per-row low: [0, 1/2]; per-row high: [1/3, 0]
    logps, old = make_logps()
    m = grpo_loss_metrics(logps, old, ADV, MASK, loss_type="dapo")
    assert set(m) == {f"clip_ratio/{k}" for k in ("low_mean", "high_mean", "region_mean", "low_min", "high_max")}
    close(m["clip_ratio/low_mean"], 1 / 5)
    close(m["clip_ratio/high_mean"], 1 / 5)
    close(m["clip_ratio/region_mean"], 2 / 5)
    close(m["clip_ratio/low_min"], 0.0)
    close(m["clip_ratio/high_max"], 1 / 3)
    # metrics use r after the delta cap: delta = 1.4 caps r = 1.5 to 1.4, still > 1.2 -> unchanged;
    # delta = 1.1 caps it to 1.1 < 1.2 -> no longer high-clipped
    close(grpo_loss_metrics(logps, old, ADV, MASK, delta=1.4)["clip_ratio/high_mean"], 1 / 5)
    close(grpo_loss_metrics(logps, old, ADV, MASK, delta=1.1)["clip_ratio/high_mean"], 0.0)
    assert not any(v.requires_grad for v in m.values())  # metrics are detached


def test_cispo_and_kl_metrics() -> None:
    logps, old = make_logps()
    m = grpo_loss_metrics(logps, old, ADV, MASK, loss_type="cispo", epsilon_high=1.2)
    assert set(m) == {"cispo_clip_ratio"}
    close(m["cispo_clip_ratio"], 1 / 5)  # r = 1.5 > 1.2 with A > 0
    lp, ref = torch.tensor(KL_LOGPS), torch.tensor(KL_REF)
    old1 = torch.tensor([[-1.2, -1.5]])
    k = torch.tensor([math.exp(-0.5) - 0.5, math.e - 2])
    r = torch.exp(lp - old1)[0]
    m = grpo_loss_metrics(lp, old1, torch.zeros(1), torch.ones(1, 2), loss_type="sapo", beta=0.1, ref_logps=ref)
    assert set(m) == {"kl"}
    close(m["kl"], (k * r).mean(), atol=1e-6)
    m = grpo_loss_metrics(
        lp, old1, torch.zeros(1), torch.ones(1, 2), beta=0.1, ref_logps=ref, use_bias_correction_kl=False
    )
    close(m["kl"], k.mean(), atol=1e-6)


# --------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, "loss_type='ppo'"),
        ({"importance_sampling_level": "row"}, "importance_sampling_level='row'"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"beta": 0.1}, "ref_logps"),
        ({"beta": -1.0, "ref_logps": torch.zeros(2, 3)}, "beta=-1.0"),
        ({"delta": 0.9}, "delta=0.9"),
        ({"epsilon": -0.1}, "epsilon=-0.1"),
        ({"loss_type": "sapo", "sapo_temperature_pos": 0.0}, "sapo_temperature_pos=0.0"),
        ({"ref_logps": torch.zeros(2, 4), "beta": 0.1}, "ref_logps"),
    ],
)
def test_loss_validation(kwargs: dict, match: str) -> None:
    logps, old = make_logps()
    with pytest.raises(ValueError, match=match):
        grpo_policy_loss(logps, old, ADV, MASK, **kwargs)


def test_shape_validation() -> None:
    logps, old = make_logps()
    with pytest.raises(ValueError, match="advantages"):
        grpo_policy_loss(logps, old, torch.zeros(3), MASK)
    with pytest.raises(ValueError, match="mask"):
        grpo_policy_loss(logps, old, ADV, MASK[:, :2])
