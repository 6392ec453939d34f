"""The reference-model component (:class:`~lit_trainer.modules.reference.ReferenceModel`) and the preference bases:
each way of building the reference, the TR-DPO mixing on hand-checked tensors, where a batch's reference log-probs
come from, the checkpoint reconciliation, and KTOModule as a sibling of DPOModule (not a subclass)."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest
import torch
import transformers

from helpers.models import tiny_llama
from lit_trainer import DPOModule, GRPOModule, KTOModule
from lit_trainer.modules.base import frozen_copy
from lit_trainer.modules.base._peft import AdapterReference
from lit_trainer.modules.kto import KTO_METRIC_NAMES
from lit_trainer.modules.preference import PreferenceModule, ReferencePreferenceModule
from lit_trainer.modules.reference import ReferenceModel

LORA = {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}


class _Host(torch.nn.Module):
    """The least a ReferenceModel reads of its module: a policy, ``is_peft``, ``default_reference`` and ``device``."""

    is_peft = False
    device = torch.device("cpu")

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(2, 2)
        self.model.register_buffer("counter", torch.tensor([7.0]))

    def default_reference(self) -> torch.nn.Module:
        return frozen_copy(self.model)


def _fill(module: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


def _values(module: torch.nn.Module) -> set[float]:
    return {float(x) for p in module.parameters() for x in p.detach().flatten()}


# ------------------------------------------------------------------------------------------------ the modes
def test_a_frozen_copy_of_the_policy_by_default():
    host = _Host()
    reference = ReferenceModel(host)
    reference.build(None)
    assert reference.mode == "copy" and reference.network is host.ref_model
    assert host.ref_model is not host.model and not host.ref_model.training
    assert all(not p.requires_grad for p in host.ref_model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(host.ref_model.parameters(), host.model.parameters()))
    assert [n for n, _ in host.state_dict().items() if n.startswith("ref_model.")] == [
        "ref_model.weight",
        "ref_model.bias",
        "ref_model.counter",
    ]


def test_a_separate_model_is_frozen_and_the_policy_itself_is_refused():
    host, separate = _Host(), torch.nn.Linear(2, 2)
    reference = ReferenceModel(host)
    reference.build(separate, disable_dropout=True)
    assert reference.mode == "model" and host.ref_model is separate
    assert not separate.training and not any(p.requires_grad for p in separate.parameters())
    with pytest.raises(ValueError, match=r"`_Host\(ref_model=...\)` is the policy object itself"):
        reference.build(host.model)


def test_precompute_without_a_copy_then_released():
    host = _Host()
    reference = ReferenceModel(host, precompute=True)
    reference.build(None)
    assert reference.mode == "policy" and host.ref_model is None  # the untrained policy scores the data
    separate = ReferenceModel(host, precompute=True)
    separate.build(torch.nn.Linear(2, 2))
    separate.release()
    assert separate.mode == "released" and host.ref_model is None


def test_lora_reference_is_the_policy_with_adapters_disabled():
    module = DPOModule(tiny_llama(seed=0, hidden=8), peft_config=LORA)
    assert module.reference.mode == "adapters" and isinstance(module.ref_model, AdapterReference)
    assert not any(k.startswith("ref_model.") for k in module.state_dict())  # no copy of the weights
    with pytest.raises(ValueError, match=r"sync_ref_model=True\)` with `peft_config`"):
        DPOModule(tiny_llama(seed=0, hidden=8), peft_config=LORA, sync_ref_model=True)


def _no_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def test_grpo_uses_the_component_and_beta_zero_has_no_reference():
    options = {"reward_funcs": [_no_reward], "tokenizer": transformers.ByT5Tokenizer()}
    with_kl = GRPOModule(tiny_llama(seed=0, hidden=8), beta=0.04, **options)
    assert with_kl.reference.mode == "copy" and isinstance(with_kl.ref_model, torch.nn.Module)
    without = GRPOModule(tiny_llama(seed=0, hidden=8), beta=0.0, **options)
    assert without.reference.mode == "none" and without.ref_model is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sync": True, "precompute": True}, r"sync_ref_model=True, precompute_ref_log_probs=True\)` is invalid"),
        ({"mixup_alpha": 1.5}, r"ref_model_mixup_alpha=1.5, ref_model_sync_steps=512\)` is invalid"),
        ({"sync_steps": 0}, r"ref_model_sync_steps=0\)` is invalid"),
        ({"precompute_batch_size": 0}, r"`precompute_ref_batch_size=0` is invalid"),
    ],
)
def test_invalid_options_are_refused_with_the_value(options: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        ReferenceModel(_Host(), **options)


# ------------------------------------------------------------------------------------------------- TR-DPO
def test_sync_mixes_parameters_by_hand_and_leaves_buffers():
    host = _Host()
    reference = ReferenceModel(host, sync=True, mixup_alpha=0.6, sync_steps=2)
    reference.build(None)
    _fill(host.ref_model, 1.0)
    _fill(host.model, 3.0)
    reference.sync(alpha=0.25)  # 0.75 * 1 + 0.25 * 3 = 1.5
    assert _values(host.ref_model) == {1.5} and _values(host.model) == {3.0}
    reference.maybe_sync(1)  # not a multiple of the period: untouched
    assert _values(host.ref_model) == {1.5}
    reference.maybe_sync(2)  # alpha 0.6: 0.4 * 1.5 + 0.6 * 3 = 2.4
    (mixed,) = _values(host.ref_model)  # every parameter equal; float32 rounding of 0.4 and 0.6 (1 ulp ~ 2.4e-7)
    assert abs(mixed - 2.4) < 1e-6
    assert torch.equal(host.ref_model.counter, torch.tensor([7.0]))  # buffers are not mixed


def test_sync_is_off_unless_asked_and_needs_a_network():
    host = _Host()
    reference = ReferenceModel(host)
    reference.build(None)
    _fill(host.ref_model, 1.0)
    _fill(host.model, 3.0)
    reference.maybe_sync(512)
    assert _values(host.ref_model) == {1.0}
    released = ReferenceModel(host, precompute=True)
    released.build(None)
    with pytest.raises(ValueError, match="needs a reference model, but there is none"):
        released.sync()


def test_sync_refuses_a_reference_whose_names_differ():
    host = _Host()
    reference = ReferenceModel(host, sync=True)
    reference.build(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="do not mirror the policy's"):
        reference.sync()


# --------------------------------------------------------------------------------------------- log-probs
def test_logps_prefers_the_precomputed_columns_then_the_live_network():
    host = _Host()
    reference = ReferenceModel(host)
    reference.build(None)
    batch = {"ref_chosen_logps": torch.tensor([-1.0], dtype=torch.float64), "ref_rejected_logps": torch.tensor([-2.0])}
    columns = ("ref_chosen_logps", "ref_rejected_logps")
    precomputed = reference.logps(batch, columns, lambda network: pytest.fail("scored despite the columns"))
    assert precomputed.dtype == torch.float32 and precomputed.tolist() == [-1.0, -2.0]

    def score(network: Any) -> torch.Tensor:
        assert network is host.ref_model and not torch.is_grad_enabled()
        return torch.tensor([5.0])

    assert reference.logps({}, columns, score).tolist() == [5.0]


def test_logps_without_columns_after_the_release_names_them_and_the_data_module():
    host = _Host()
    reference = ReferenceModel(host, precompute=True, data_module="UnpairedPreferenceDataModule")
    reference.build(None)
    reference.release()
    with pytest.raises(ValueError, match=r"no `ref_logps` and the reference model has been released.*Unpaired"):
        reference.logps({}, ("ref_logps",), lambda network: torch.zeros(1))


# ------------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_weights_are_dropped_without_a_network_and_filled_with_one():
    host = _Host()
    released = ReferenceModel(host, precompute=True)
    released.build(None)
    checkpoint = {"state_dict": {"model.weight": torch.zeros(2, 2), "ref_model.weight": torch.ones(2, 2)}}
    released.on_load_checkpoint(checkpoint)
    assert list(checkpoint["state_dict"]) == ["model.weight"]

    kept = ReferenceModel(host)
    kept.build(None)
    checkpoint = {"state_dict": {"model.weight": torch.zeros(2, 2)}}
    kept.on_load_checkpoint(checkpoint)
    assert sorted(checkpoint["state_dict"]) == [
        "model.weight",
        "ref_model.bias",
        "ref_model.counter",
        "ref_model.weight",
    ]


# ----------------------------------------------------------------------------------------- the preference bases
def test_kto_is_a_sibling_of_dpo_with_only_its_own_options():
    assert not issubclass(KTOModule, DPOModule) and not issubclass(DPOModule, KTOModule)
    assert issubclass(KTOModule, ReferencePreferenceModule) and issubclass(DPOModule, ReferencePreferenceModule)
    kto_options = set(inspect.signature(KTOModule).parameters)
    assert not kto_options & {"loss_weights", "label_smoothing", "f_divergence_type", "ld_alpha", "discopop_tau"}


def test_kto_constructor_runs_every_base_constructor_once():
    inits = {
        c.__dict__["__init__"].__code__: c.__name__
        for c in KTOModule.__mro__
        if "__init__" in c.__dict__ and c.__module__.startswith("lit_trainer")
    }
    calls: list[str] = []

    def record(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in inits:
            calls.append(inits[frame.f_code])

    sys.setprofile(record)
    try:
        module = KTOModule(tiny_llama(seed=0, hidden=8, dropout=0.1))
    finally:
        sys.setprofile(None)
    assert sorted(calls) == sorted(inits.values())  # each constructor of the chain once, none skipped
    assert "PreferenceModule" in calls and "DPOModule" not in calls
    # what the shared base's constructor does: the policy's dropout off, KTO's validation metrics
    assert all(m.attention_dropout == 0.0 for m in module.model.modules() if hasattr(m, "attention_dropout"))
    assert module.val_metrics.names == ["loss", *KTO_METRIC_NAMES]
    assert isinstance(module, PreferenceModule) and module.reference.mode == "copy"
