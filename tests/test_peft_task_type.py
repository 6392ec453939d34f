"""A ``peft_config`` or saved adapter of another task than the module's is refused at construction: on a causal-LM
module (SFT, DPO, GRPO) a ``SEQ_CLS`` adapter would train and export an adapter marked for sequence classification;
on the reward module a ``CAUSAL_LM`` one would leave the new score head frozen (and unsaved)."""

from __future__ import annotations

import pytest

from lit_trainer import CausalLMModule, DPOModule, GRPOModule, RewardModule
from lit_trainer.rewards import arithmetic_reward

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("task_type", ["SEQ_CLS", "TOKEN_CLS", "FEATURE_EXTRACTION"])
@pytest.mark.parametrize(
    "make", [CausalLMModule, DPOModule, lambda *a, **k: GRPOModule(*a, reward_funcs=[arithmetic_reward], **k)]
)
def test_a_causal_lm_module_refuses_another_task_type(make, task_type):
    with pytest.raises(ValueError, match=rf"task_type={task_type!r}.*causal.*task_type: CAUSAL_LM"):
        make("tiny-64", peft_config={**LORA, "task_type": task_type})


def test_a_peft_config_object_of_another_task_is_refused_and_the_default_stays():
    import peft

    with pytest.raises(ValueError, match=r"task_type='SEQ_CLS'"):
        CausalLMModule("tiny-64", peft_config=peft.LoraConfig(task_type="SEQ_CLS", **LORA))
    assert CausalLMModule("tiny-64", peft_config=LORA).model.peft_config["default"].task_type == "CAUSAL_LM"
    assert RewardModule("tiny-64", peft_config=LORA).model.peft_config["default"].task_type == "SEQ_CLS"


def test_a_saved_adapter_of_another_task_is_refused(tmp_path):
    RewardModule("tiny-64", peft_config=LORA).model.save_pretrained(tmp_path / "reward")
    CausalLMModule("tiny-64", peft_config=LORA).model.save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match=r"adapter_path=.*reward.*task_type='SEQ_CLS'.*CAUSAL_LM"):
        CausalLMModule("tiny-64", adapter_path=str(tmp_path / "reward"))
    with pytest.raises(ValueError, match=r"adapter_path=.*causal.*task_type='CAUSAL_LM'.*SEQ_CLS"):
        RewardModule("tiny-64", adapter_path=str(tmp_path / "causal"))
    assert CausalLMModule("tiny-64", adapter_path=str(tmp_path / "causal")).is_peft  # the matching ones load
    assert RewardModule("tiny-64", adapter_path=str(tmp_path / "reward")).is_peft


def test_a_saved_adapter_without_a_task_type_still_loads(tmp_path):
    """Plain peft code often saves a LoraConfig with no task_type (None in its adapter_config.json); such an adapter
    loaded before the task-type check and must still load (there is nothing to contradict)."""
    import peft

    base = CausalLMModule("tiny-64").model
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert model.peft_config["default"].task_type is None
    model.save_pretrained(tmp_path / "plain")
    assert CausalLMModule("tiny-64", adapter_path=str(tmp_path / "plain")).is_peft
