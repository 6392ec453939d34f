"""Tolerances for results that may differ by float32 rounding only, calibrated by the test on the machine it runs on.

Two float32 computations of the same mathematics in different reduction orders (sharded or DDP ranks against one
process, accumulated micro-batches against one full batch, 1 or 2 intra-op threads) differ by rounding, and by how
much depends on the computation (Adam's ``1/sqrt(v)`` amplifies the rounding of small gradients, the more so the
larger the learning rate and the more steps) and on the machine (its BLAS kernels' blocking and vector width). A
fixed tolerance fitted on one machine is therefore a flaky test on another. Instead a test measures the float32
rounding scale of its own reference computation, where it runs: the same computation once in float32 and once in
float64 from the same (float32) starting point. float64 rounds 2**29 times finer, so it stands for the exact result,
and the scale is how far a float32 evaluation of THIS computation lands from it. Two float32 evaluations in other
orders each land about that far from it, so they are at most about twice that apart; :data:`FACTOR` allows twice
that again (the two orders need not be equally accurate), and never less than :data:`FACTOR` float32 units.

The measure is the relative L2 difference over all tensors, ``||a - b|| / ||b||``, not the largest elementwise one:
under Adam a few weights whose gradient is near zero turn rounding into a sizeable update (``m / sqrt(v)`` of noise
is of order one), so the largest elementwise difference is one chaotic element's lottery (measured on the sharded
BEMA run: one ``down_proj`` weight 6e-5 off in float32 against float64 while the median weight is 4e-9 off, and
between two float32 orders 3.6e-5 on one machine and much less on another), while the L2 difference of all the
weights is the scale of the rounding as a whole.

The check stays able to fail: a test also passes the size of a real mistake (e.g. one optimizer step's change of the
weights, or the difference of two gradient normalisations), and :meth:`Rounding.check` requires the bound to be
:data:`MARGIN` times smaller than that, so a wrong update fails by orders of magnitude rather than by luck.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

FLOAT32_UNIT = 2.0**-24  # unit roundoff of float32: no relative difference of float32 results is meaningfully smaller
FACTOR = 4.0  # two float32 evaluations, each about `scale` from the exact result, are at most ~2 x scale apart; x2
MARGIN = 100.0  # a real mistake must be at least this many bounds away, or the comparison could not tell it apart

Tensors = Mapping[str, torch.Tensor]


def relative_l2(a: Tensors, b: Tensors) -> float:
    """``||a - b|| / ||b||`` over all tensors of ``b`` together, in float64 (the gradient comparisons' measure)."""
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b)
    den = sum((b[k].double() ** 2).sum() for k in b)
    return float((num / den).sqrt())


def values(xs: list[float]) -> dict[str, torch.Tensor]:
    """A list of numbers (e.g. validation losses) as one tensor, for :func:`relative_l2`."""
    return {"values": torch.tensor(xs, dtype=torch.float64)}


@dataclass(frozen=True)
class Rounding:
    """The float32 rounding scale of one computation, and the tolerance it gives.

    Args:
        scale: ``measure(float32 result, float64 result)`` of the reference computation.
        measure: the difference measure the comparisons use (the same one as ``scale``).
        what: names the quantity in messages.
    """

    scale: float
    measure: Callable[[Tensors, Tensors], float] = relative_l2
    what: str = "result"

    @classmethod
    def of(
        cls,
        float32: Tensors,
        float64: Tensors,
        measure: Callable[[Tensors, Tensors], float] = relative_l2,
        what: str = "result",
    ) -> Rounding:
        """Calibrate on the reference computation's float32 and float64 results."""
        return cls(measure(float32, float64), measure, what)

    @property
    def bound(self) -> float:
        return FACTOR * max(self.scale, FLOAT32_UNIT)

    def check(self, got: Tensors, expected: Tensors, *, mistake: float) -> float:
        """Assert ``measure(got, expected) <= bound`` and ``bound * MARGIN <= mistake``; return the difference.

        Args:
            got: the float32 result computed in another order (sharded, DDP, accumulated).
            expected: the float32 reference result.
            mistake: the same measure's size of a real error the comparison must catch (e.g. one step's update).
        """
        observed = self.measure(got, expected)
        print(  # shown with `pytest -s` or on failure: the measured numbers behind the tolerance
            f"rounding[{self.what}]: observed {observed:.2e}, bound {self.bound:.2e} "
            f"(scale {self.scale:.2e}), mistake {mistake:.2e}"
        )
        assert observed <= self.bound, (
            f"{self.what}: float32 difference {observed:.3e} exceeds {FACTOR:g} x this computation's float32 rounding "
            f"scale {self.scale:.3e} (its float32 vs float64 result on this machine): more than reduction order differs"
        )
        assert self.bound * MARGIN <= mistake, (
            f"{self.what}: the bound {self.bound:.3e} is not {MARGIN:g} times below a real mistake's size "
            f"{mistake:.3e}: the comparison could not tell a wrong result from rounding"
        )
        return observed
