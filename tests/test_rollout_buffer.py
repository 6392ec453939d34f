"""RolloutBuffer round counting across a resume that could not restore the buffered rollouts."""

from __future__ import annotations

import torch

from lit_trainer.modules.online_rl._rollout_buffer import RolloutBuffer


def _fill(buffer: RolloutBuffer) -> None:
    slices = [{"x": torch.tensor([i])} for i in range(buffer.steps_per_generation)]
    buffer.fill(slices, torch.ones(buffer.steps_per_generation), {})


def test_refill_of_an_interrupted_round_regenerates_that_round_not_the_next():
    buffer = RolloutBuffer(steps_per_generation=2, num_iterations=1)
    buffer.end_round()
    assert buffer.next_round_index == 0
    _fill(buffer)
    buffer.next()
    assert (buffer.served, buffer.rounds) == (1, 1)
    # a resume with another world size restores the counters only: the interrupted round is round 0
    resumed = RolloutBuffer(steps_per_generation=2, num_iterations=1)
    resumed.load_state_dict({"served": 1, "rounds": 1}, torch.device("cpu"))
    assert resumed.needs_refill and resumed.next_round_index == 0
    _fill(resumed)
    assert (resumed.served, resumed.rounds) == (1, 1)  # the position in the round is kept, no round is counted
    assert resumed.next()[1] == 1  # the round's second micro-batch
    assert resumed.needs_refill and resumed.next_round_index == 1  # then round 1, as in the first run
    _fill(resumed)
    assert (resumed.served, resumed.rounds) == (0, 2)
