"""GRPO dapo/cispo: token-exact optimizer steps when a step spans two generation rounds (steps_per_generation is not
a multiple of accumulate_grad_batches)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from test_grpo_module import QUIET, data, grpo, step_reference, tiny_model

from helpers.accumulation import GradCapture


def _record_micro_batches(module) -> list[dict[str, torch.Tensor]]:
    seen: list[dict[str, torch.Tensor]] = []
    inner = module.compute_loss

    def spy(batch, num_items_in_batch):
        seen.append({k: v.detach().clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return inner(batch, num_items_in_batch)

    module.compute_loss = spy
    return seen


@pytest.mark.slow
def test_dapo_step_spanning_two_generation_rounds_is_token_exact():
    # spg = 3, accumulate 2: step 0 = round 0 slices 0, 1; step 1 = round 0 slice 2 + round 1 slice 0
    model = tiny_model(3, eos_bias=5.0)  # EOS likely: completion lengths vary
    initial = copy.deepcopy(model)
    module = grpo(
        model, loss_type="dapo", temperature=0.8, steps_per_generation=3, max_completion_length=6, learning_rate=0.0
    )  # lr 0: every step's reference uses the initial weights
    seen = _record_micro_batches(module)
    capture = GradCapture()
    trainer = L.Trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[capture], **QUIET)
    trainer.fit(module, datamodule=data(batch_size=4))
    assert len(seen) == 4 and len(capture.grads) == 2
    assert module._buffer.rounds == 2
    tokens = [int(s["completion_mask"].sum()) for s in seen]
    # the reference's approximate normaliser (round 0's tokens x 2/3) is not step 1's token count
    assert abs(sum(tokens[:3]) * 2 / 3 - (tokens[2] + tokens[3])) > 1
    for grads, micro in zip(capture.grads, (seen[0:2], seen[2:4])):
        step_reference(initial, micro, "dapo", 0.8).check(grads)  # calibrated: float64 twin, a row lost


def test_a_step_correction_outside_param_grad_is_refused_at_setup():
    module = grpo(loss_type="cispo", steps_per_generation=3)
    # a strategy that keeps gradients out of `param.grad` (DeepSpeed; clipping set, so only this refusal applies)
    module._trainer = SimpleNamespace(
        strategy=type("DeepSpeedStrategy", (), {})(),
        accumulate_grad_batches=2,
        world_size=1,
        gradient_clip_val=1.0,
        datamodule=data(batch_size=4),
    )
    with pytest.raises(ValueError, match="steps_per_generation=3 not a multiple of accumulate_grad_batches=2"):
        module.setup("fit")


def test_step_normaliser_sums_the_step_slices_or_estimates_across_rounds():
    from lit_trainer.modules.grpo._normaliser import StepNormaliser

    tokens = torch.tensor([3.0, 5.0, 7.0])  # three slices per round
    inside = StepNormaliser.start(tokens, position=4, length=2, round_length=6)  # slices 1, 2 of the second pass
    assert inside.exact and inside.provisional.item() == 12.0 and inside.correction() is None
    wrapped = StepNormaliser.start(tokens, position=2, length=3, round_length=6)  # slices 2, 0, 1
    assert wrapped.exact and wrapped.provisional.item() == 15.0
    spanning = StepNormaliser.start(tokens, position=2, length=2, round_length=3)  # reaches the next round
    assert not spanning.exact and spanning.provisional.item() == 10.0  # 15 tokens x 2 / 3 slices
    spanning.add(tokens[2])
    spanning.add(torch.tensor(8.0))
    assert spanning.correction().item() == pytest.approx(10.0 / 15.0)  # tolerance: float32 10/15 vs float64
