"""Derived seeds: one generator seed per ``(seed, part, part, ...)``, through the SplitMix64 hash.

Used wherever a random stream must be reproducible per step, rank or round without touching the global RNG: NEFTune's
noise draws (``(seed, rank, draw)``) and GRPO's sampling and buffer shuffle (``(seed, round, rank, stream)``). A
hash, not ``seed + offset``: nearby inputs give unrelated streams, and a resumed run derives the same seeds again.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One SplitMix64 output for the state ``x`` (Steele, Lea and Flood 2014): a fixed bijection on 64-bit ints."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *parts: int) -> int:
    """``h = splitmix64(seed)``, then ``h = splitmix64(h ^ part)`` per part; returns ``h >> 1``.

    Every input is taken modulo 2**64 (a negative seed works). The result is a non-negative 63-bit integer, valid for
    ``torch.Generator.manual_seed``.
    """
    h = splitmix64(seed & _MASK64)
    for part in parts:
        h = splitmix64(h ^ (part & _MASK64))
    return h >> 1
