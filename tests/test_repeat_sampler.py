"""RepeatSampler order, sharding and resume; GRPO batch geometry."""

from __future__ import annotations

import pytest
import torch

from lit_trainer.data.samplers.repeat_sampler import RepeatSampler, needs_old_logps, resolve_generation_geometry


class FixedPermutation(RepeatSampler):
    """The reference example's permutation, to check the ordering independently of the RNG."""

    def _permutation(self) -> torch.Tensor:
        return torch.tensor([4, 3, 0, 1, 2, 6, 5])


def test_reference_example() -> None:
    # G = 2, 3 prompts per chunk, repeat 4, permutation [4, 3, 0, 1, 2, 6, 5]; the trailing chunk [5] is dropped
    sampler = FixedPermutation(7, mini_repeat_count=2, batch_size=3, repeat_count=4)
    assert list(sampler) == [4, 4, 3, 3, 0, 0] * 4 + [1, 1, 2, 2, 6, 6] * 4
    assert len(sampler) == (7 // 3) * 3 * 2 * 4  # 48


def test_shuffled_order_uses_seeded_randperm_per_epoch() -> None:
    sampler = RepeatSampler(10, mini_repeat_count=3, batch_size=5, repeat_count=2, seed=7)
    gen = torch.Generator().manual_seed(7)
    perms = [torch.randperm(10, generator=gen).tolist() for _ in range(3)]  # epochs 0, 1, 2

    def expected(perm: list[int]) -> list[int]:
        out = []
        for chunk in (perm[:5], perm[5:]):
            out += [i for i in chunk for _ in range(3)] * 2
        return out

    assert list(sampler) == expected(perms[0])
    sampler.set_epoch(2)
    assert list(sampler) == expected(perms[2])
    sampler.set_epoch(1)
    assert list(sampler) == expected(perms[1])
    assert perms[0] != perms[1]


def test_two_ranks_take_contiguous_slices_of_each_emission() -> None:
    # each emission of 3 prompts x G=2 = 6 rows: rank 0 gets rows 0-2, rank 1 rows 3-5
    kwargs = dict(mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False)
    rank0 = list(RepeatSampler(6, **kwargs, num_replicas=2, rank=0))
    rank1 = list(RepeatSampler(6, **kwargs, num_replicas=2, rank=1))
    assert rank0 == [0, 0, 1] * 2 + [3, 3, 4] * 2
    assert rank1 == [1, 2, 2] * 2 + [4, 5, 5] * 2
    assert len(RepeatSampler(6, **kwargs, num_replicas=2, rank=1)) == 12


def test_resume_position() -> None:
    sampler = RepeatSampler(9, mini_repeat_count=2, batch_size=4, repeat_count=3, seed=3)
    sampler.set_epoch(1)
    full = list(sampler)
    it = iter(sampler)
    head = [next(it) for _ in range(11)]
    state = sampler.state_dict()
    assert state == {"epoch": 1, "position": 11}
    resumed = RepeatSampler(9, mini_repeat_count=2, batch_size=4, repeat_count=3, seed=3)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert head + tail == full
    assert resumed.state_dict() == {"epoch": 1, "position": len(full)}
    assert list(resumed) == full  # the offset applies to one iteration only
    # a checkpoint taken at the end of epoch 1, then Lightning starting epoch 2: the offset must not apply
    resumed.load_state_dict(resumed.state_dict())
    resumed.set_epoch(2)
    assert len(list(resumed)) == len(full)
    # same epoch re-announced after loading (Lightning calls set_epoch on resume): the offset stays
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(resumed) == tail
    with pytest.raises(ValueError, match="position=999"):
        resumed.load_state_dict({"epoch": 0, "position": 999})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_prompts": 2, "batch_size": 3}, "num_prompts=2, batch_size=3"),
        ({"mini_repeat_count": 0}, "mini_repeat_count=0"),
        ({"repeat_count": 0}, "repeat_count=0"),
        ({"num_replicas": 4, "rank": 0}, "multiple of 4"),
        ({"num_replicas": 2, "rank": 2}, "rank=2"),
    ],
)
def test_sampler_validation(kwargs: dict, match: str) -> None:
    args = {"num_prompts": 6, "mini_repeat_count": 2, "batch_size": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        RepeatSampler(**args)


def test_geometry() -> None:
    # default: spg = accumulate_grad_batches, gbs = b * P * GA = 4 * 2 * 3
    assert resolve_generation_geometry(4, 8, 2, 3) == (3, 24)
    # steps_per_generation given: gbs = 4 * 2 * 4
    assert resolve_generation_geometry(4, 8, 2, 1, steps_per_generation=4) == (4, 32)
    # generation_batch_size given: spg = 64 / (4 * 2)
    assert resolve_generation_geometry(4, 8, 2, 1, generation_batch_size=64) == (8, 64)
    # b need not be a multiple of G: 3 * 1 * 2 = 6 rows, G = 3
    assert resolve_generation_geometry(3, 3, 1, 2) == (2, 6)


def test_geometry_errors_propose_a_valid_setting() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolve_generation_geometry(4, 8, 1, 1, steps_per_generation=2, generation_batch_size=8)
    # 20 is not a multiple of b*P = 8: nearest multiple 16
    with pytest.raises(ValueError, match="generation_batch_size=20.*e.g. generation_batch_size=16"):
        resolve_generation_geometry(4, 4, 2, 1, generation_batch_size=20)
    # 4 * 2 * 3 = 24 not a multiple of 16; spg must be a multiple of 16 / gcd(16, 8) = 2 -> 4 (gbs 32)
    with pytest.raises(ValueError, match="steps_per_generation=4 \\(generation_batch_size=32\\)"):
        resolve_generation_geometry(4, 16, 2, 3)
    with pytest.raises(ValueError, match="num_generations=1"):
        resolve_generation_geometry(4, 1, 1, 1)
    with pytest.raises(ValueError, match="per_device_batch_size=0"):
        resolve_generation_geometry(0, 8, 1, 1)
    with pytest.raises(ValueError, match="steps_per_generation=0"):
        resolve_generation_geometry(4, 8, 1, 1, steps_per_generation=0)


def test_needs_old_logps() -> None:
    assert not needs_old_logps(4, 4, 1)  # default spg = GA: one generation per optimizer step
    assert not needs_old_logps(4, 2, 2)  # reference example: both passes inside one optimizer step
    assert needs_old_logps(1, 1, 2)  # mu > 1 across optimizer steps
    assert needs_old_logps(2, 4, 1)  # spg > GA
