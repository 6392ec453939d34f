"""GRPO prompt order: each prompt repeated for its G completions, each generation batch replayed, resumable.

Also the GRPO batch-geometry rules (TRL's ``GRPOConfig``, docs/design.md#trl-grpo) in
:func:`resolve_generation_geometry`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lit_trainer.data.samplers.batch_sampler import EpochPosition


def _default_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class RepeatSampler(EpochPosition, Sampler[int]):
    """Yields prompt indices in the GRPO order of the reference ``RepeatSampler``, this rank's share only.

    Global order: a permutation of ``range(num_prompts)`` (``torch.randperm`` from a generator seeded with ``seed``;
    identity without ``shuffle``) is cut into chunks of ``batch_size`` unique prompts (a partial last chunk is
    dropped); each chunk is emitted ``repeat_count`` times in a row, and within an emission every index is repeated
    ``mini_repeat_count`` times. Example (``mini_repeat_count=2, batch_size=3, repeat_count=4``, permutation
    ``[4, 3, 0, 1, 2, 6, 5]``): ``4,4,3,3,0,0`` four times, then ``1,1,2,2,6,6`` four times.

    Under ``num_replicas = P > 1`` every emission (``batch_size * mini_repeat_count`` rows) is cut into P contiguous
    slices and rank ``p`` yields the ``p``-th: the reference's contiguous sharding, so each rank generates for its own
    prompts. Use it with ``Trainer(use_distributed_sampler=False)`` (Lightning would otherwise re-shard it).

    Epoch ``e`` uses the ``(e+1)``-th permutation drawn from the seeded generator, as the reference's generator
    advancing once per epoch; :meth:`set_epoch` picks it, so any epoch can be regenerated on resume.

    Args:
        num_prompts: dataset size.
        mini_repeat_count: consecutive copies of each index (``num_generations``).
        batch_size: unique prompts per chunk (``generation_batch_size / num_generations``).
        repeat_count: emissions of each chunk (``num_iterations * steps_per_generation``).
        shuffle: permute the prompts (else ``0..num_prompts-1``).
        seed: seed of the permutation generator (identical on every rank).
        num_replicas: number of ranks; default the initialised process group's size (1 without one).
        rank: this rank; default the process group's rank (0 without one).

    Raises:
        ValueError: if a count is < 1, there are fewer prompts than ``batch_size``, the emission does not split evenly
            across ranks, or ``rank`` is out of range.

    Example:
        >>> list(RepeatSampler(4, mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False))
        [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]

    Resume (``set_epoch``, ``state_dict``/``load_state_dict`` with ``{"epoch", "position"}`` in indices) comes from
    :class:`~lit_trainer.data.samplers.EpochPosition`; after a whole epoch the position stays at ``len()``.
    A prefetching DataLoader runs ahead of training: a caller that knows the consumed batches can store
    ``consumed_batches * loader_batch_size`` as the position instead.
    """

    _rewind_at_epoch_end = False  # the state after a whole epoch says so: {"epoch": e, "position": len(self)}

    def __init__(
        self,
        num_prompts: int,
        mini_repeat_count: int,
        batch_size: int,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        for name, value in (("mini_repeat_count", mini_repeat_count), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"`RepeatSampler({name}={value})` is invalid: it must be >= 1.")
        if repeat_count < 1:
            raise ValueError(f"`RepeatSampler(repeat_count={repeat_count})` is invalid: it must be >= 1.")
        if num_prompts < batch_size:
            raise ValueError(
                f"`RepeatSampler(num_prompts={num_prompts}, batch_size={batch_size})` yields nothing: a generation "
                f"batch needs {batch_size} distinct prompts. Add prompts or lower the generation batch size."
            )
        world, this_rank = _default_world()
        num_replicas = world if num_replicas is None else num_replicas
        rank = this_rank if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"`RepeatSampler(num_replicas={num_replicas}, rank={rank})` is invalid: need 0 <= rank < num_replicas."
            )
        rows = batch_size * mini_repeat_count
        if rows % num_replicas != 0:
            raise ValueError(
                f"`RepeatSampler`: a generation batch of {rows} rows (batch_size={batch_size} x mini_repeat_count="
                f"{mini_repeat_count}) does not split over {num_replicas} ranks; make it a multiple of {num_replicas}."
            )
        self.num_prompts, self.mini_repeat_count, self.batch_size = num_prompts, mini_repeat_count, batch_size
        self.repeat_count, self.shuffle, self.seed = repeat_count, shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_prompts)
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch):  # replay the draws of earlier epochs: the reference's advancing generator
            torch.randperm(self.num_prompts, generator=generator)
        return torch.randperm(self.num_prompts, generator=generator)

    def indices(self) -> list[int]:
        """This rank's full index list for the current epoch (what iterating yields without a resume offset)."""
        num_chunks = self.num_prompts // self.batch_size
        chunks = self._permutation()[: num_chunks * self.batch_size].reshape(num_chunks, self.batch_size)
        emissions = chunks.repeat_interleave(self.mini_repeat_count, dim=1)  # (chunks, rows)
        share = emissions.shape[1] // self.num_replicas
        local = emissions[:, self.rank * share : (self.rank + 1) * share]
        return local.repeat_interleave(self.repeat_count, dim=0).reshape(-1).tolist()

    def _iter_from(self, start: int) -> Iterator[int]:
        return iter(self.indices()[start:])

    def __len__(self) -> int:
        rows = (self.num_prompts // self.batch_size) * self.batch_size * self.mini_repeat_count
        return rows * self.repeat_count // self.num_replicas


def _suggest_spg(per_rank_rows: int, num_generations: int, spg: int) -> int:
    """Smallest steps_per_generation >= spg with ``per_rank_rows * spg`` divisible by ``num_generations``."""
    step = num_generations // math.gcd(num_generations, per_rank_rows)
    return math.ceil(spg / step) * step


def resolve_generation_geometry(
    per_device_batch_size: int,
    num_generations: int,
    world_size: int,
    accumulate_grad_batches: int,
    steps_per_generation: int | None = None,
    generation_batch_size: int | None = None,
) -> tuple[int, int]:
    """GRPO batch geometry (TRL's ``GRPOConfig`` rules): returns ``(steps_per_generation, generation_batch_size)``.

    With ``b = per_device_batch_size`` and ``P = world_size``: neither given -> ``spg = accumulate_grad_batches``;
    ``generation_batch_size`` given -> it must be a multiple of ``b * P`` and ``spg = gbs / (b * P)``;
    ``steps_per_generation`` given -> ``gbs = b * P * spg``. Then ``gbs`` must be a multiple of ``num_generations``.
    ``b`` itself need not be (a prompt group may span micro-batches).

    Args:
        per_device_batch_size: completions per micro-batch per rank.
        num_generations: completions per prompt (>= 2).
        world_size: number of ranks.
        accumulate_grad_batches: micro-batches per optimizer step.
        steps_per_generation: micro-steps served by one generation (exclusive with ``generation_batch_size``).
        generation_batch_size: completions generated at once over all ranks.

    Returns:
        ``(steps_per_generation, generation_batch_size)``.

    Raises:
        ValueError: with a valid setting to use instead.

    Example:
        >>> resolve_generation_geometry(4, 8, world_size=2, accumulate_grad_batches=2)
        (2, 16)
    """
    b, g, p = per_device_batch_size, num_generations, world_size
    sizes = (("per_device_batch_size", b), ("world_size", p), ("accumulate_grad_batches", accumulate_grad_batches))
    for name, value in sizes:
        if value < 1:
            raise ValueError(f"`{name}={value}` is invalid: it must be >= 1.")
    if g < 2:
        raise ValueError(f"`num_generations={g}` is invalid: GRPO compares completions of a prompt, use >= 2 (e.g. 8).")
    if steps_per_generation is not None and generation_batch_size is not None:
        raise ValueError(
            f"`steps_per_generation={steps_per_generation}` and `generation_batch_size={generation_batch_size}` are "
            "mutually exclusive: set only one (generation_batch_size = per_device_batch_size x world_size x "
            "steps_per_generation)."
        )
    if steps_per_generation is not None and steps_per_generation < 1:
        raise ValueError(f"`steps_per_generation={steps_per_generation}` is invalid: it must be >= 1.")
    if generation_batch_size is not None:
        if generation_batch_size < 1 or generation_batch_size % (b * p) != 0:
            valid = max(1, round(generation_batch_size / (b * p))) * b * p
            raise ValueError(
                f"`generation_batch_size={generation_batch_size}` is invalid: it must be a positive multiple of "
                f"per_device_batch_size x world_size = {b * p}, e.g. generation_batch_size={valid}."
            )
        spg = generation_batch_size // (b * p)
    else:
        spg = accumulate_grad_batches if steps_per_generation is None else steps_per_generation
    gbs = b * p * spg
    if gbs % g != 0:
        fix = _suggest_spg(b * p, g, spg)
        raise ValueError(
            f"generation_batch_size={gbs} (per_device_batch_size={b} x world_size={p} x steps_per_generation={spg}) is "
            f"not a multiple of num_generations={g}. Use steps_per_generation={fix} (generation_batch_size="
            f"{b * p * fix}), or a per_device_batch_size that makes the product a multiple of {g}."
        )
    return spg, gbs


def needs_old_logps(accumulate_grad_batches: int, steps_per_generation: int, num_iterations: int) -> bool:
    """Whether old log-probs must be stored at generation time (as TRL's GRPOTrainer decides).

    They are needed iff one generation batch is used across more than one optimizer step, i.e.
    ``accumulate_grad_batches % (steps_per_generation * num_iterations) != 0``; otherwise the run is on-policy and
    the loss uses ``old = logps.detach()``.

    Args:
        accumulate_grad_batches: micro-batches per optimizer step.
        steps_per_generation: micro-steps served by one generation.
        num_iterations: passes over each generation batch.

    Returns:
        True when the policy may have moved between generation and loss.

    Example:
        >>> needs_old_logps(4, 2, 2), needs_old_logps(1, 4, 1)
        (False, True)
    """
    return accumulate_grad_batches % (steps_per_generation * num_iterations) != 0
