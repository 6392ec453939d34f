"""The one seed-derivation function (``lit_trainer.core.seeding``) and its two users, NEFTune and the GRPO rollouts."""

from __future__ import annotations

import torch

from lit_trainer.callbacks.neftune import draw_seed
from lit_trainer.core.seeding import derive_seed, splitmix64
from lit_trainer.generation.engines import rollout_seed

# the first two outputs of SplitMix64 seeded with 0 (the published test vector of Vigna's splitmix64.c): the states
# are GAMMA and 2 * GAMMA, i.e. splitmix64(0) and splitmix64(GAMMA)
GAMMA = 0x9E3779B97F4A7C15
FIRST, SECOND = 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4


def test_splitmix64_matches_the_published_sequence():
    assert splitmix64(0) == FIRST
    assert splitmix64(GAMMA) == SECOND


def test_derive_seed_chains_the_hash_over_the_parts_and_drops_the_low_bit():
    assert derive_seed(0) == FIRST >> 1
    # splitmix64(0) ^ part = 0 -> the chain gives splitmix64(0) again; ^ part = GAMMA -> the second output
    assert derive_seed(0, FIRST) == FIRST >> 1
    assert derive_seed(0, FIRST ^ GAMMA) == SECOND >> 1
    assert derive_seed(0, FIRST, FIRST ^ GAMMA) == SECOND >> 1
    assert derive_seed(-1) == derive_seed(2**64 - 1) and derive_seed(2**64) == derive_seed(0)  # modulo 2**64
    assert all(0 <= derive_seed(s, r) < 2**63 for s in (0, 1, 2**70) for r in (0, 5))
    torch.Generator().manual_seed(derive_seed(2**64 - 1, 3))  # a valid torch seed


def test_neftune_and_rollout_seeds_are_derived_seeds_with_the_values_they_had():
    # values of the two former copies of the hash, before they were merged: the noise and the rollouts are unchanged
    assert draw_seed(123, 0, 0) == 8482180211807696622
    assert draw_seed(2**40 + 5, 1, 17) == 8176514115279888668
    assert rollout_seed(7, 3, 1) == 5506226826624142905
    assert rollout_seed(7, 3, 1, stream=1) == 1413493754657903361
    assert rollout_seed(-1, 0, 0) == 35539978295723851
    assert draw_seed(9, 2, 4) == derive_seed(9, 2, 4)
    assert rollout_seed(9, 2, 4, stream=1) == derive_seed(9, 2, 4, 1)
