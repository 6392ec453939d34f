"""DPO pair losses (every pair-level type of TRL 1.16's ``DPOTrainer``) and the small pure helpers around them.

Notation (pair ``i``): ``π_c, π_r`` are the policy's per-sequence summed log-probs of the chosen and rejected
completion, ``ρ_c, ρ_r`` the reference model's, ``u = π − ρ`` the log-ratios, ``s = f(u)`` the f-divergence score
(``s = u`` for the default reverse KL), ``Δ = s_c − s_r``, ``β = beta``, ``ε = label_smoothing``, ``σ`` sigmoid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

DPOLossType = Literal[
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
    "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm",
]  # fmt: skip
FDivergenceType = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]

DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)
F_DIVERGENCE_TYPES: tuple[str, ...] = get_args(FDivergenceType)
# Loss types that accept a non-default f-divergence (the reference's list; "sft" is token-level, see DPOModule).
F_DIVERGENCE_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft",
)  # fmt: skip
LENGTH_NORMALISED_LOSS_TYPES: tuple[str, ...] = ("ipo", "sigmoid_norm")

_ALPHA_EXP_CAP = 80.0  # max exponent for alpha_divergence (fp32 / bf16)
_ALPHA_EXP_CAP_FP16 = 11.0  # e^11 ≈ 59874 still fits in fp16 (max 65504)


@dataclass(frozen=True)
class _Pair:
    """Everything a pair loss may read; built once per call."""

    pi_c: torch.Tensor
    pi_r: torch.Tensor
    ref_c: torch.Tensor
    ref_r: torch.Tensor
    s_c: torch.Tensor
    s_r: torch.Tensor
    n_c: torch.Tensor | None
    n_r: torch.Tensor | None
    beta: float
    eps: float
    tau: float

    @property
    def u_c(self) -> torch.Tensor:
        return self.pi_c - self.ref_c

    @property
    def u_r(self) -> torch.Tensor:
        return self.pi_r - self.ref_r

    @property
    def z(self) -> torch.Tensor:
        """``βΔ``, the scaled score margin."""
        return self.beta * (self.s_c - self.s_r)

    @property
    def normalised_margin(self) -> torch.Tensor:
        """``s_c/n_c − s_r/n_r`` (lengths are checked before any loss runs)."""
        return self.s_c / self.n_c - self.s_r / self.n_r


def _alpha_divergence(u: torch.Tensor, coef: float) -> torch.Tensor:
    if abs(coef - 1.0) < 1e-6:  # the limit a -> 1 is reverse KL
        return u
    cap = _ALPHA_EXP_CAP_FP16 if u.dtype == torch.float16 else _ALPHA_EXP_CAP
    # at least float32 (float64 stays float64), not cast back: |s| reaches 1.1e35 for a = 0.5, far past fp16's range
    exponent = ((coef - 1.0) * u.to(torch.promote_types(u.dtype, torch.float32))).clamp(max=cap)
    return (torch.exp(exponent) - 1.0) / (coef - 1.0)


_F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda u, a: u,
    "forward_kl": lambda u, a: 1.0 - torch.exp(-u),
    "js_divergence": lambda u, a: math.log(2.0) + F.logsigmoid(u),
    "alpha_divergence": _alpha_divergence,
}


def _smoothed_logistic(z: torch.Tensor, eps: float) -> torch.Tensor:
    """``−(1−ε)·logσ(z) − ε·logσ(−z)`` (the conservative / cDPO form used by aot)."""
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _sorted_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.sort(a).values - torch.sort(b).values


def _robust(p: _Pair) -> torch.Tensor:
    return (-(1.0 - p.eps) * F.logsigmoid(p.z) + p.eps * F.logsigmoid(-p.z)) / (1.0 - 2.0 * p.eps)


def _exo_pair(p: _Pair) -> torch.Tensor:
    z = p.z
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-p.eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - math.log(p.eps)
    )


def _nca_pair(p: _Pair) -> torch.Tensor:
    zc, zr = p.beta * p.u_c, p.beta * p.u_r
    return -F.logsigmoid(zc) - 0.5 * F.logsigmoid(-zc) - 0.5 * F.logsigmoid(-zr)


def _sppo_hard(p: _Pair) -> torch.Tensor:
    half_inv_beta = 1.0 / (2.0 * p.beta)
    return (p.u_c - half_inv_beta) ** 2 + (p.u_r + half_inv_beta) ** 2


def _discopop(p: _Pair) -> torch.Tensor:
    z = p.z
    modulation = torch.sigmoid(z / p.tau)
    return (1.0 - modulation) * -F.logsigmoid(z) + modulation * torch.exp(-z)


_PAIR_LOSSES: dict[str, Callable[[_Pair], torch.Tensor]] = {
    "sigmoid": lambda p: -F.logsigmoid(p.z),
    "hinge": lambda p: torch.relu(1.0 - p.z),
    "ipo": lambda p: (p.normalised_margin - 1.0 / (2.0 * p.beta)) ** 2,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "bco_pair": lambda p: -F.logsigmoid(p.beta * p.u_c) - F.logsigmoid(-p.beta * p.u_r),
    "sppo_hard": _sppo_hard,
    "aot": lambda p: _smoothed_logistic(p.beta * _sorted_diff(p.pi_c - p.pi_r, p.ref_c - p.ref_r), p.eps),
    "aot_unpaired": lambda p: _smoothed_logistic(p.beta * _sorted_diff(p.u_c, p.u_r), p.eps),
    "apo_zero": lambda p: (1.0 - torch.sigmoid(p.beta * p.u_c)) + torch.sigmoid(p.beta * p.u_r),
    "apo_down": lambda p: torch.sigmoid(p.beta * p.u_c) + (1.0 - torch.sigmoid(p.beta * (p.u_c - p.u_r))),
    "discopop": _discopop,
    "sigmoid_norm": lambda p: -F.logsigmoid(p.beta * p.normalised_margin),
}


def _check_options(loss_type: str, f_divergence_type: str, beta: float, eps: float, tau: float) -> None:
    if loss_type == "sft":
        raise ValueError(
            "`dpo_loss(loss_type='sft')` is invalid: 'sft' is a token-level loss (the mean policy log-prob of the "
            "chosen completion tokens), not a pair loss; use it through `DPOModule(loss_type=[..., 'sft'])`."
        )
    if loss_type not in _PAIR_LOSSES:
        raise ValueError(f"`dpo_loss(loss_type={loss_type!r})` is invalid: choose one of {DPO_LOSS_TYPES}.")
    if f_divergence_type not in _F_DIVERGENCES:
        raise ValueError(
            f"`dpo_loss(f_divergence_type={f_divergence_type!r})` is invalid: choose one of {F_DIVERGENCE_TYPES}."
        )
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(
            f"`dpo_loss(loss_type={loss_type!r}, f_divergence_type={f_divergence_type!r})` is invalid: a "
            f"non-default f-divergence is only supported by {F_DIVERGENCE_LOSS_TYPES}; use "
            "f_divergence_type='reverse_kl' or one of those loss types."
        )
    if not beta > 0:
        raise ValueError(f"`dpo_loss(beta={beta})` is invalid: beta must be > 0.")
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"`dpo_loss(label_smoothing={eps})` is invalid: it must be in [0, 1).")
    if loss_type == "exo_pair" and eps == 0.0:
        raise ValueError(
            "`dpo_loss(loss_type='exo_pair', label_smoothing=0.0)` is invalid: EXO needs label_smoothing > 0 "
            "(it takes log(label_smoothing)); use a small value such as 1e-3."
        )
    if loss_type == "robust" and eps >= 0.5:
        raise ValueError(
            f"`dpo_loss(loss_type='robust', label_smoothing={eps})` is invalid: the robust loss divides by "
            "1 - 2*label_smoothing, so it must be in [0, 0.5)."
        )
    if not tau > 0:
        raise ValueError(f"`dpo_loss(discopop_tau={tau})` is invalid: discopop_tau must be > 0.")


def _check_shapes(logps: tuple[torch.Tensor, ...], lengths: tuple[torch.Tensor | None, ...], loss_type: str) -> None:
    names = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
    shapes = {name: tuple(t.shape) for name, t in zip(names, logps)}
    first = shapes["chosen_logps"]
    if len(first) != 1 or any(shape != first for shape in shapes.values()):
        raise ValueError(
            f"`dpo_loss` needs four 1-D per-sequence log-prob tensors of the same shape (B,), got {shapes}; sum the "
            "per-token log-probs over completion tokens first (see `sequence_logps`)."
        )
    if loss_type in LENGTH_NORMALISED_LOSS_TYPES and any(t is None for t in lengths):
        raise ValueError(
            f"`dpo_loss(loss_type={loss_type!r})` needs chosen_lengths and rejected_lengths (completion token "
            "counts per pair): it normalises each sequence log-prob by its length."
        )
    for name, t in zip(("chosen_lengths", "rejected_lengths"), lengths):
        if t is not None and tuple(t.shape) != first:
            raise ValueError(f"`dpo_loss({name}=...)` has shape {tuple(t.shape)}; it must match the log-probs {first}.")


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    loss_type: DPOLossType = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    discopop_tau: float = 0.05,
    f_divergence_type: FDivergenceType = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
) -> torch.Tensor:
    """Per-pair DPO losses ``ℓ_i`` (TRL 1.16 semantics); the training loss is their mean.

    With ``z = βΔ``:

    - ``sigmoid``: ``−logσ(z)``; ``hinge``: ``relu(1 − z)``;
    - ``ipo``: ``(s_c/n_c − s_r/n_r − 1/(2β))²``; ``sigmoid_norm``: ``−logσ(β(s_c/n_c − s_r/n_r))``;
    - ``exo_pair``: ``σ(z)(logσ(z) − log(1−ε)) + σ(−z)(logσ(−z) − log ε)``;
    - ``nca_pair``: ``−logσ(βu_c) − ½logσ(−βu_c) − ½logσ(−βu_r)``;
    - ``robust``: ``(−(1−ε)logσ(z) + ε·logσ(−z)) / (1−2ε)``;
    - ``bco_pair``: ``−logσ(βu_c) − logσ(−βu_r)`` (no running reward shift, as the reference);
    - ``sppo_hard``: ``(u_c − 1/(2β))² + (u_r + 1/(2β))²``;
    - ``aot``: ``d = sort(π_c − π_r) − sort(ρ_c − ρ_r)`` (each sorted ascending across the batch), then
      ``−(1−ε)logσ(βd) − ε·logσ(−βd)``; ``aot_unpaired``: the same with ``d = sort(u_c) − sort(u_r)``.
      Entry ``i`` belongs to the i-th sorted position, not to pair ``i``; only the mean is meaningful;
    - ``apo_zero``: ``1 − σ(βu_c) + σ(βu_r)``; ``apo_down``: ``σ(βu_c) + 1 − σ(β(u_c − u_r))``;
    - ``discopop``: ``m = σ(z/τ)``, ``(1−m)(−logσ(z)) + m·e^{−z}``.

    f-divergence scores: ``reverse_kl`` ``s = u``; ``forward_kl`` ``s = 1 − e^{−u}``; ``js_divergence``
    ``s = ln 2 + logσ(u)``; ``alpha_divergence`` ``s = (e^{(a−1)u} − 1)/(a−1)`` with the exponent computed in
    float32 and clamped at 80 (11 for float16 inputs), and reverse KL when ``|a − 1| < 1e-6``. nca_pair, bco_pair,
    sppo_hard, aot*, apo_* always use ``u``.

    ``label_smoothing`` is read by robust, exo_pair, aot and aot_unpaired only (as in TRL 1.16, where sigmoid has
    no cDPO smoothing); other types ignore it. ``"sft"`` (RPO's NLL term) is not a pair loss: it is a token-level
    mean over all chosen completion tokens and lives in ``DPOModule``.

    Differs from the reference: robust with ``label_smoothing >= 0.5`` raises instead of warning (the loss would be
    infinite or have its sign flipped).

    Args:
        chosen_logps: ``(B,)`` policy log-probs of the chosen completions, summed over completion tokens.
        rejected_logps: ``(B,)`` the same for the rejected completions.
        ref_chosen_logps: ``(B,)`` reference-model log-probs of the chosen completions (no grad needed).
        ref_rejected_logps: ``(B,)`` the same for the rejected completions.
        loss_type: one of ``DPO_LOSS_TYPES``.
        beta: temperature ``β`` (IPO's ``τ``); must be > 0.
        label_smoothing: ``ε`` in ``[0, 1)``; ``(0, 1)`` for exo_pair and ``[0, 0.5)`` for robust.
        chosen_lengths: ``(B,)`` completion token counts of the chosen rows, clamped at min 1; ipo, sigmoid_norm.
        rejected_lengths: ``(B,)`` the same for the rejected rows.
        discopop_tau: ``τ`` of discopop; must be > 0.
        f_divergence_type: one of ``F_DIVERGENCE_TYPES``; non-default only for ``F_DIVERGENCE_LOSS_TYPES``.
        f_alpha_divergence_coef: ``a`` of alpha_divergence.

    Returns:
        ``(B,)`` per-pair losses in the dtype of the inputs (at least float32 with alpha_divergence).

    Raises:
        ValueError: for an unknown or unsupported option combination (see above), ``beta <= 0``, a bad
            ``label_smoothing`` or ``discopop_tau``, missing lengths for ipo/sigmoid_norm, or mismatched shapes.

    Example:
        >>> pi_c, pi_r = torch.tensor([-3.0]), torch.tensor([-4.0])
        >>> ref_c, ref_r = torch.tensor([-3.5]), torch.tensor([-3.5])
        >>> dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.1)  # -logsigmoid(0.1 * (0.5 - (-0.5)))
        tensor([0.6444])
    """
    _check_options(loss_type, f_divergence_type, beta, label_smoothing, discopop_tau)
    logps = (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    _check_shapes(logps, (chosen_lengths, rejected_lengths), loss_type)
    score, coef = _F_DIVERGENCES[f_divergence_type], f_alpha_divergence_coef
    n_c, n_r = (None if n is None else n.clamp(min=1).to(logps[0].dtype) for n in (chosen_lengths, rejected_lengths))
    s_c, s_r = score(chosen_logps - ref_chosen_logps, coef), score(rejected_logps - ref_rejected_logps, coef)
    pair = _Pair(*logps, s_c, s_r, n_c, n_r, beta=beta, eps=label_smoothing, tau=discopop_tau)
    return _PAIR_LOSSES[loss_type](pair)


def dpo_rewards_metrics(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> dict[str, torch.Tensor]:
    """TRL's per-micro-batch DPO reward metrics, detached 0-d tensors (no host sync).

    Rewards always use the reverse-KL log-ratios ``u = π − ρ``, whatever the f-divergence of the loss.

    Args:
        chosen_logps: ``(B,)`` policy per-sequence log-probs of the chosen completions.
        rejected_logps: ``(B,)`` the same for the rejected completions.
        ref_chosen_logps: ``(B,)`` reference log-probs of the chosen completions.
        ref_rejected_logps: ``(B,)`` reference log-probs of the rejected completions.
        beta: the loss's ``β``.

    Returns:
        ``rewards/chosen = mean(βu_c)``, ``rewards/rejected = mean(βu_r)``,
        ``rewards/accuracies = mean(1[βu_c > βu_r])`` (strict), ``rewards/margins = mean(β(u_c − u_r))``,
        ``logps/chosen = mean(π_c)`` and ``logps/rejected = mean(π_r)``.

    Example:
        >>> m = dpo_rewards_metrics(torch.tensor([-3.0]), torch.tensor([-4.0]), torch.tensor([-3.5]),
        ...                         torch.tensor([-3.5]), beta=0.1)
        >>> round(m["rewards/margins"].item(), 4)
        0.1
    """
    with torch.no_grad():
        reward_c = beta * (chosen_logps - ref_chosen_logps).detach()
        reward_r = beta * (rejected_logps - ref_rejected_logps).detach()
        return {
            **pair_reward_metrics(reward_c, reward_r),
            "logps/chosen": chosen_logps.detach().mean(),
            "logps/rejected": rejected_logps.detach().mean(),
        }


def pair_reward_metrics(reward_c: torch.Tensor, reward_r: torch.Tensor) -> dict[str, torch.Tensor]:
    """``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` (strict ``>``) and ``rewards/margins`` of the
    pairs' ``(B,)`` rewards, detached 0-d tensors (DPO's, and the reference-free losses' from the policy alone)."""
    reward_c, reward_r = reward_c.detach(), reward_r.detach()
    return {
        "rewards/chosen": reward_c.mean(),
        "rewards/rejected": reward_r.mean(),
        "rewards/accuracies": (reward_c > reward_r).float().mean(),
        "rewards/margins": (reward_c - reward_r).mean(),
    }


def sequence_logps(per_token_logps: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None = None) -> torch.Tensor:
    """Per-row sum of completion-token log-probs, optionally with LD-DPO's length-desensitised weighting.

    Rows ``0..B-1`` are the chosen and rows ``B..2B-1`` the rejected completions of the same pairs (one forward
    of ``2B`` rows). With ``ld_alpha``, completion positions are counted 1, 2, ... along each row's mask; with
    ``ℓ_c, ℓ_r`` the pair's completion lengths and ``s = min(ℓ_c, ℓ_r)``, both rows of the pair get
    ``Σ_{pos ≤ s} logp_t + ld_alpha · Σ_{pos > s} logp_t``. Apply it to the reference log-probs too.

    Args:
        per_token_logps: ``(2B, T)`` shifted per-token log-probs (see ``losses.logprobs.per_token_logps``).
        mask: ``(2B, T)`` shifted completion mask (bool or 0/1); positions outside it contribute nothing.
        ld_alpha: LD-DPO weight of the tokens past the shorter completion of the pair; None = plain sum.

    Returns:
        ``(2B,)`` per-sequence log-probs in the dtype of ``per_token_logps``.

    Raises:
        ValueError: if the shapes differ, or ``ld_alpha`` is given with an odd number of rows.

    Example:
        >>> logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        >>> sequence_logps(logps, mask, ld_alpha=0.5)  # chosen: -1 - 2 + 0.5 * -3
        tensor([-4.5000, -2.0000])
    """
    if per_token_logps.shape != mask.shape or per_token_logps.dim() != 2:
        raise ValueError(
            f"`sequence_logps` needs 2-D per_token_logps and mask of the same shape, got "
            f"{tuple(per_token_logps.shape)} and {tuple(mask.shape)}."
        )
    keep = mask.bool()
    logps = torch.where(keep, per_token_logps, torch.zeros_like(per_token_logps))
    if ld_alpha is None:
        return logps.sum(-1)
    rows = logps.shape[0]
    if rows % 2:
        raise ValueError(
            f"`sequence_logps(ld_alpha={ld_alpha})` needs chosen rows 0..B-1 then rejected rows B..2B-1, got an odd "
            f"number of rows ({rows})."
        )
    position = keep.long().cumsum(-1)  # 1-based index of each completion token in its row
    lengths = keep.sum(-1)
    shared = torch.minimum(lengths[: rows // 2], lengths[rows // 2 :]).repeat(2)
    weights = torch.where(position <= shared[:, None], 1.0, ld_alpha).to(logps.dtype)
    return (logps * weights).sum(-1)
