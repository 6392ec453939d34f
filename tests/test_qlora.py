"""QLoRA: a bitsandbytes-quantized base (NF4/FP4 4-bit, LLM.int8) with LoRA adapters, and bitsandbytes' 8-bit and paged
AdamW, on CPU (bitsandbytes >= 0.50 has a CPU backend).

What is pinned: the ``quantization`` forms and every refusal (bitsandbytes missing, an unknown type or key, 4-bit
without an adapter, a model object with ``quantization``, sharding); the base really is packed 4-bit and stays
bit-identical while the adapters train; a quantized load keeps no full-precision copy nor the checkpoint's mapping;
DPO's reference is the quantized base itself; checkpoints hold the adapter and the 8-bit optimizer state only and a JIT
resume is bit-exact; the merged export is a plain transformers model in the base's dtype whose logits equal the QLoRA
model's to the merge's rounding; the reward model's score head trains; 2-rank DDP matches one process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import bitsandbytes as bnb  # the test extra installs it
import lightning.pytorch as pl
import peft
import pytest
import qlora_common  # tests/scripts
import torch
from lightning.pytorch.callbacks import Callback
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from helpers.rounding import Rounding, relative_l2
from lit_trainer import CausalLMModule, DPOModule, RewardModule
from lit_trainer.callbacks import BEMA, ExactResume, HFExport, JITCheckpoint
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.modules.base import _peft
from lit_trainer.quantization import as_bnb_config

LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}


def test_quantization_forms() -> None:
    nf4 = as_bnb_config("nf4", torch.bfloat16)
    assert nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4" and nf4.bnb_4bit_use_double_quant
    assert nf4.bnb_4bit_compute_dtype == torch.bfloat16
    assert as_bnb_config("fp4").bnb_4bit_quant_type == "fp4" and as_bnb_config("int8").load_in_8bit
    mapping = {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "bfloat16"}
    from_yaml = as_bnb_config(mapping)
    assert from_yaml.bnb_4bit_quant_type == "fp4" and from_yaml.bnb_4bit_compute_dtype == torch.bfloat16
    given = BitsAndBytesConfig(load_in_4bit=True)
    assert as_bnb_config(given).to_dict() == given.to_dict() and as_bnb_config(given) is not given
    module = CausalLMModule("tiny-64", quantization=mapping, peft_config=LORA)
    assert module.hparams.quantization == mapping  # plain values: checkpoints stay loadable with weights_only
    assert CausalLMModule("tiny-64", quantization=given, peft_config=LORA).hparams.quantization["load_in_4bit"]


@pytest.mark.parametrize(
    ("quantization", "match"),
    [
        ("nf5", r"`quantization='nf5'` is not a known quantization: choose one of \('nf4', 'fp4', 'int8'\)"),
        ({"load_in_4bits": True}, r"unknown keys \['load_in_4bits'\]: give arguments of .*BitsAndBytesConfig"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, r"bnb_4bit_quant_type='int4': .* 'nf4' .* 'fp4'"),
        ({"bnb_4bit_quant_type": "nf4"}, "must set exactly one of load_in_4bit and load_in_8bit"),
    ],
)
def test_bad_quantization_is_refused_before_loading(quantization: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CausalLMModule("tiny-64", quantization=quantization, peft_config=LORA)


def test_refusals_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"no adapter is given: quantized weights .* Add `peft_config`"):
        CausalLMModule("tiny-64", quantization="nf4")
    with pytest.raises(ValueError, match=r"no adapter is given: .* or pass the model unquantized"):
        CausalLMModule(load_model("tiny-64", quantization="nf4"))  # quantized by the caller
    with pytest.raises(ValueError, match=r"applies to a model given by name or path.*quantization_config="):
        CausalLMModule(load_model("tiny-64"), quantization="nf4", peft_config=LORA)
    with pytest.raises(ValueError, match=r"`optim='adamw_9bit'` is not a known optimizer"):
        CausalLMModule("tiny-64", optim="adamw_9bit")
    with pytest.raises(ValueError, match="Keep one: remove `optimizer`"):
        CausalLMModule("tiny-64", optim="adamw_8bit", optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    install = r'needs the bitsandbytes library, which is not installed: pip install "lit_trainer\[qlora\]"'
    with pytest.raises(ImportError, match=install):
        CausalLMModule("tiny-64", quantization="nf4", peft_config=LORA)
    from lit_trainer.modules.base import _optimization

    _optimization._bnb_adamw.cache_clear()
    try:
        with pytest.raises(ImportError, match=install):
            _optimization.build_adamw("adamw_8bit", [{"params": [torch.nn.Parameter(torch.ones(2))]}], 0.1, False)
    finally:
        _optimization._bnb_adamw.cache_clear()


def test_sharding_refuses_quantized_bases_and_bitsandbytes_optimizers() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    module = CausalLMModule("tiny-64", quantization="nf4", peft_config=LORA)
    sharded = SimpleNamespace(strategy=ModelParallelStrategy())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CausalLMModule, "trainer", property(lambda self: sharded))
        with pytest.raises(ValueError, match=r"a quantized base \(`quantization`\) cannot be sharded .*strategy='ddp'"):
            module.check_low_bit_strategy()
        full = CausalLMModule("tiny-64", optim="paged_adamw_8bit")
        with pytest.raises(ValueError, match=r"a bitsandbytes optimizer \(`optim='paged_adamw_8bit'`\) cannot be"):
            full.check_low_bit_strategy()
        sharded.strategy = DDPStrategy()
        module.check_low_bit_strategy()  # DDP is fine


def _packed_layer(module: Any) -> Any:
    return module.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer


def test_base_is_packed_4bit_and_dpo_reference_is_the_quantized_base(tmp_path: Path) -> None:
    pl.seed_everything(0)
    load_model("tiny-64").save_pretrained(tmp_path / "base")
    load_tokenizer("tiny-64").save_pretrained(tmp_path / "base")
    module = DPOModule(str(tmp_path / "base"), quantization="nf4", peft_config=LORA, precompute_ref_log_probs=False)
    layer = _packed_layer(module)
    assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.dtype == torch.uint8
    assert layer.weight.numel() * 2 == layer.in_features * layer.out_features  # two 4-bit values per byte
    assert {n for n, p in module.named_parameters() if p.requires_grad} == {
        n for n, _ in module.named_parameters() if ".lora_" in n
    }
    assert isinstance(module.ref_model, _peft.AdapterReference)
    torch.manual_seed(1)  # a non-zero adapter: the policy now differs from the base
    for name, param in module.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    quantized_base = load_model(str(tmp_path / "base"), quantization="nf4").eval()
    with torch.no_grad():
        expected = quantized_base(input_ids=ids).logits
        assert not torch.allclose(module.model(input_ids=ids).logits, expected)
    before = qlora_common.base_checksum(module)
    assert torch.equal(module.ref_model(input_ids=ids).logits, expected)  # same bytes, same kernels: bit-exact
    # an eval-mode forward without gradients left the packed bytes alone (bitsandbytes would repack them for its
    # AVX512-BF16 CPU kernel, with bfloat16 scales, on CPUs that have it: lit_trainer.quantization.keep_standard_layout)
    assert qlora_common.base_checksum(module) == before
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in module.modules())


class _SignalAt(Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(root: Path, callbacks: list, ckpt_path: str | None = None, steps: int = 4) -> CausalLMModule:
    module = qlora_common.module(peft_config={**qlora_common.LORA, "lora_dropout": 0.1})
    trainer = qlora_common.trainer(max_steps=steps, default_root_dir=root, callbacks=[ExactResume(), *callbacks])
    trainer.fit(module, datamodule=qlora_common.datamodule(batch_size=4), ckpt_path=ckpt_path)
    return module


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 steps of QLoRA + 8-bit AdamW with a merged and an adapter export; the same run stopped by SIGTERM after
    step 2 (JIT checkpoint) and resumed."""
    root = tmp_path_factory.mktemp("qlora")
    initial = qlora_common.base_checksum(qlora_common.module())
    bema = BEMA(update_after=1)
    exports = [HFExport(str(root / "merged"), merge_adapters=True), HFExport(str(root / "adapter"))]
    full = _fit(root / "full", [*exports, bema])
    jit = JITCheckpoint(kill_wait=0, dirpath=str(root / "jit"), exit_code=None)
    _fit(root / "stopped", [jit, _SignalAt(1)])  # saved after step 2
    resumed = _fit(root / "resumed", [], ckpt_path=jit.checkpoint_path)
    return {
        "root": root,
        "initial": initial,
        "full": full,
        "resumed": resumed,
        "bema": bema,
        "jit": jit.checkpoint_path,
    }


@pytest.mark.slow
def test_jit_resume_with_8bit_adamw_is_bit_exact_and_checkpoints_hold_the_adapter(qlora_runs: dict[str, Any]) -> None:
    full, resumed = qlora_runs["full"], qlora_runs["resumed"]
    assert qlora_common.base_checksum(full) == qlora_runs["initial"]  # the packed base never changed
    expected, got = qlora_common.adapter(full), qlora_common.adapter(resumed)
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)
    averaged = qlora_runs["bema"].bema_state_dict()  # BEMA averages the adapters, nothing of the packed base
    assert averaged.keys() == {f"model.{n}" for n in expected}
    saved = torch.load(qlora_runs["jit"], weights_only=True)
    assert saved["global_step"] == 2 and saved["state_dict"] and all(".lora_" in k for k in saved["state_dict"])
    states = saved["optimizer_states"][0]["state"].values()
    quantized_state = [s["__bnb_optimizer_quant_state__"]["state1"] for s in states]
    assert quantized_state and all(t.dtype == torch.uint8 for t in quantized_state)  # 8-bit Adam moments


@pytest.mark.slow
def test_merged_export_is_plain_transformers_and_matches_the_qlora_model(qlora_runs: dict[str, Any]) -> None:
    root, module = qlora_runs["root"], qlora_runs["full"]
    config = json.loads((root / "merged" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"  # the base's own dtype
    merged = AutoModelForCausalLM.from_pretrained(root / "merged").eval()
    assert not any("bitsandbytes" in type(m).__module__ for m in merged.modules())
    ids = torch.randint(3, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    module.model.eval()
    with torch.no_grad():
        qlora = module.model(input_ids=ids).logits
        with module.model.disable_adapter():
            base = module.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        pl.seed_everything(0)  # the preset's weights, as qlora_common.module drew them
        on_quantized_base = peft.PeftModel.from_pretrained(
            load_model("tiny", quantization="nf4"), root / "adapter"
        ).eval()  # the adapter export, on a fresh quantized base
        adapter_export = on_quantized_base(input_ids=ids).logits
    # the merge computes x (W + s BA)^T where QLoRA computes x W^T + s (x A^T) B^T: float32 reassociation only. A
    # merge that missed the adapter misses by its effect; one into other weights (the unquantized originals) by the
    # quantization error; both are compared with the gap
    effect = relative_l2({"l": base}, {"l": qlora})
    gap = relative_l2({"l": got}, {"l": qlora})
    print(f"merged vs QLoRA logits: {gap:.2e} (the adapter's effect: {effect:.2e})")
    assert effect > 1e-3 and gap < effect / 1000, (gap, effect)
    assert torch.equal(adapter_export, qlora)


def test_reward_model_on_a_quantized_base_trains_its_score_head() -> None:
    pl.seed_everything(0)
    module = RewardModule("tiny-64", quantization="nf4", peft_config=LORA)
    score = module.model.get_base_model().score
    assert isinstance(score.modules_to_save["default"], torch.nn.Linear)  # not quantized, trained whole
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable) and any(".lora_" in n for n in trainable)


def test_a_quantized_load_keeps_no_full_precision_copy_nor_the_checkpoint_mapping(tmp_path: Path) -> None:
    """After ``load_model(path, quantization=...)`` the process holds the model and nothing else of the checkpoint: no
    float tensor beside the module's own (a full-precision weight kept alive after quantization would be one), and
    no mapping of the safetensors file (views of it kept every page read while quantizing resident: docs/qlora.md)."""
    import gc

    pl.seed_everything(0)
    load_model("tiny-64").save_pretrained(tmp_path / "base")
    checkpoint = str(tmp_path / "base" / "model.safetensors")
    gc.collect()
    before = {id(o) for o in gc.get_objects() if torch.is_tensor(o)}
    model = load_model(str(tmp_path / "base"), quantization="nf4")
    gc.collect()
    states = [m.weight.quant_state for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    constants = [getattr(q, n, None) for s in states for q in (s, s.state2) for n in ("absmax", "code", "offset")]
    constants = [t for t in constants if torch.is_tensor(t)]
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *constants]}
    new_floats = [
        o
        for o in gc.get_objects()
        if torch.is_tensor(o)
        and id(o) not in before
        and o.is_floating_point()
        and o.untyped_storage().data_ptr() not in own
    ]
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    smallest = min(m.in_features * m.out_features for m in quantized) * 4  # one float32 weight's bytes
    stray = sum(o.untyped_storage().nbytes() for o in new_floats)
    assert quantized and stray < smallest, [(tuple(o.shape), o.dtype) for o in new_floats if o.numel() > 256]
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            assert checkpoint not in maps.read()


def test_int8_base_trains_the_adapter() -> None:
    pl.seed_everything(0)
    module = CausalLMModule("tiny-64", quantization="int8", peft_config=LORA)
    assert isinstance(_packed_layer(module), bnb.nn.Linear8bitLt)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    loss, _ = module.compute_loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, None)
    loss.backward()
    grads = [p.grad for n, p in module.named_parameters() if "lora_B" in n]  # (A gets none while B is 0)
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_8bit_adamw_keeps_embeddings_in_32bit_state_under_full_fine_tuning() -> None:
    pl.seed_everything(0)
    module = CausalLMModule("tiny", optim="adamw_8bit", learning_rate=1e-3)
    optimizer = module.create_optimizer(list(module.trainable_parameters()))
    assert type(optimizer).__name__ == "BnbAdamW" and optimizer.args.optim_bits == 8
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    module.compute_loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, None)[0].backward()
    optimizer.step()
    embedding = module.model.get_input_embeddings().weight
    assert optimizer.state[embedding]["state1"].dtype == torch.float32
    mlp = module.model.model.layers[0].mlp.up_proj.weight
    assert optimizer.state[mlp]["state1"].dtype == torch.uint8
    paged = module.create_optimizer  # paged 32-bit on CPU: unpaged 32-bit state (nothing to page to)
    module.hparams.optim = "paged_adamw_32bit"
    assert paged(list(module.trainable_parameters())).args.optim_bits == 32


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_ranks_match_one_process(ddp_world) -> None:
    out = ddp_world.part("qlora")  # tests/scripts/ddp_qlora.py
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(ranks[0]["adapter"][n], ranks[1]["adapter"][n]) for n in ranks[0]["adapter"])
    single = qlora_common.module()
    initial = qlora_common.adapter(single)
    qlora_common.trainer().fit(single, datamodule=qlora_common.datamodule(batch_size=4))
    # the calibration: the same 4 rows per step as 2 accumulated micro-batches of 2, which sums two half-batch
    # gradients as DDP does; one process, so only the reduction order differs (tests/helpers/rounding.py)
    split = qlora_common.module()
    qlora_common.trainer(accumulate=2).fit(split, datamodule=qlora_common.datamodule(batch_size=2))
    expected = qlora_common.adapter(single)
    assert ranks[0]["base"] == qlora_common.base_checksum(single)
    rounding = Rounding(scale=relative_l2(qlora_common.adapter(split), expected), what="QLoRA adapters, DDP")
    step = relative_l2(initial, expected)  # the adapters' change over the run: a wrong gradient misses by this much
    rounding.check(ranks[0]["adapter"], expected, mistake=step)


def _token_sum_reward(completion_ids: list, **_: Any) -> list[float]:
    """An arbitrary reward that differs between completions (non-zero advantages)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def test_grpo_on_a_quantized_base_scores_the_reference_with_the_quantized_base() -> None:
    from lit_trainer import GRPOModule
    from lit_trainer.data import PromptDataModule, builtin

    pl.seed_everything(0)
    module = GRPOModule(
        "tiny-64",
        quantization="nf4",
        peft_config=LORA,
        beta=0.04,
        reward_funcs=[_token_sum_reward],
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-2,
        generation_seed=0,
    )
    assert isinstance(module.ref_model, _peft.AdapterReference)
    rows = builtin.prompt_rows("train").select(range(8))
    data = PromptDataModule(tokenizer="tiny", dataset=rows, val_size=0, batch_size=4, max_length=16)
    qlora_common.trainer(max_steps=3).fit(module, data)  # the adapters have moved before the last round
    pl.seed_everything(0)
    base = load_model("tiny-64", quantization="nf4").eval()  # the same packed weights, loaded afresh
    rollout = module._buffer.slices[0]
    torch.testing.assert_close(rollout["ref_logps"], module.completion_logps(base, rollout)[0], rtol=0, atol=1e-6)
    with torch.no_grad():
        policy = module.completion_logps(module.model, rollout)[0]
    assert (policy - rollout["ref_logps"]).abs().max() > 1e-4  # the reference is not the trained policy


def test_a_quantized_peft_model_given_as_an_object_is_used_as_it_is() -> None:
    pl.seed_everything(0)
    trained = CausalLMModule("tiny-64", quantization="nf4", peft_config=LORA)
    again = CausalLMModule(trained.model, tokenizer=trained.tokenizer)  # e.g. to score it: no second preparation
    assert again.model is trained.model and again.is_quantized and again.is_peft
