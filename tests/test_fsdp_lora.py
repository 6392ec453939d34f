"""LoRA adapters over an FSDP2-sharded, frozen base (``ModelParallelStrategy``) on 2 CPU ranks (gloo).

One launch of ``tests/scripts/fsdp_lora.py`` runs SFT (with distributed adapter-only checkpoints, a resume and the
adapter export), DPO (reference: adapters disabled) and GRPO (``beta > 0``: adapter-disabled reference, generation on
the sharded model, sharded and under DDP). The one-process references run here with the same global batch (per-device
batch 4 on one device = 2 per rank x 2 ranks) from the same initial weights and adapter.

Tolerances: calibrated like ``tests/test_fsdp.py`` (``tests/helpers/rounding.py``): the reference run once more in
float64 measures how far its float32 result lands from the exact one on this machine; the sharded result may be a
small multiple of that away, which must be at least 100 times below one optimizer step's change of the adapters.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import _fsdp_common as common  # tests/scripts
import lora_common  # tests/scripts
import peft
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer.modules.base import _adapter_checkpoint


@pytest.fixture(scope="module")
def run(ddp_world) -> Path:
    return ddp_world.part("fsdp_lora")  # tests/scripts/fsdp_lora.py


def _step(final: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], steps: int) -> float:
    """One optimizer step's change of the adapters, on average: the size of a wrong or missing update."""
    return relative_l2(final, initial) / steps


def _single(build, datamodule, steps: int) -> SimpleNamespace:
    """The one-process run in float32 and in float64 (the calibration), and one step's change."""
    runs = {}
    for precision in ("32-true", "64-true"):
        module = build()
        common.trainer("auto", 1, steps, [], precision=precision).fit(module, datamodule=datamodule())
        runs[precision] = lora_common.adapter_weights(module)
    weights = runs["32-true"]
    return SimpleNamespace(
        weights=weights,
        rounding=Rounding.of(weights, runs["64-true"], what="LoRA weights"),
        step=_step(weights, lora_common.adapter_weights(build()), steps),
    )


@pytest.mark.ddp
def test_sharded_lora_sft_ends_with_the_single_process_adapters(run: Path):
    sharded = torch.load(run / "sft.pt", weights_only=False)
    assert sharded["param_types"] == {"DTensor"}  # base and adapters sharded
    assert sharded["weights"] and all(".lora_" in name for name in sharded["weights"])
    single = _single(lora_common.sft_module, lambda: lora_common.sft_datamodule(4), lora_common.SFT_STEPS)
    single.rounding.check(sharded["weights"], single.weights, mistake=single.step)


@pytest.mark.ddp
def test_sharded_lora_checkpoint_holds_only_the_adapters_and_resumes_exactly(run: Path):
    folder = run / "sft_ckpt" / "step=2.ckpt"
    assert folder.is_dir()  # a distributed checkpoint: each rank wrote its shards
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("state_dict.")]
    module = lora_common.sft_module()
    trainable = {f"state_dict.{n}" for n, p in module.named_parameters() if p.requires_grad}
    assert set(weights) == trainable  # the adapters, nothing of the frozen base
    # the fingerprint of the frozen base (summed over the ranks' shards) is the one-process fingerprint
    saved = torch.load(folder / "meta.pt", weights_only=True)[_adapter_checkpoint.FINGERPRINT_KEY]
    live = _adapter_checkpoint.fingerprint(module)
    assert saved["layout"] == live["layout"] and saved["count"] == live["count"]
    # float64 sums of the same float32 values in two groupings (per shard, then added): 1e-12 relative at most
    assert math.isclose(saved["checksum"], live["checksum"], rel_tol=1e-12)
    sharded = torch.load(run / "sft.pt", weights_only=False)
    for name, value in sharded["weights"].items():  # resumed from step 2: bit for bit the uninterrupted run
        assert torch.equal(sharded["resumed"][name], value), name


@pytest.mark.ddp
def test_sharded_lora_export_is_the_gathered_adapter_and_loads_on_the_base(run: Path):
    sharded = torch.load(run / "sft.pt", weights_only=False)
    loaded = peft.PeftModel.from_pretrained(tiny_llama(seed=1, layers=2), str(run / "sft_export"))
    exported = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert exported.keys() == sharded["weights"].keys()
    for name, value in sharded["weights"].items():
        assert torch.equal(exported[name], value), name  # rank 0 wrote the gathered adapter, exactly
    # the sharded forward all-gathers exactly these weights: same values, same kernels, so the same logits
    assert torch.equal(lora_common.probe_logits(loaded), sharded["logits"])


@pytest.mark.ddp
def test_sharded_lora_dpo_with_the_adapter_disabled_reference_matches_one_process(run: Path):
    from transformers import ByT5Tokenizer

    sharded = torch.load(run / "dpo.pt", weights_only=False)
    single = _single(lora_common.dpo_module, lambda: common.dpo_datamodule(ByT5Tokenizer(), 4), lora_common.DPO_STEPS)
    single.rounding.check(sharded["weights"], single.weights, mistake=single.step)


@pytest.mark.ddp
def test_sharded_lora_grpo_matches_ddp(run: Path):
    for rank in (0, 1):
        grpo = torch.load(run / f"grpo_rank{rank}.pt", weights_only=False)
        assert grpo["sharded"]["longest"] == grpo["ddp"]["longest"] == grpo["ddp64"]["longest"]  # same completions
        ddp = grpo["ddp"]["weights"]
        rounding = Rounding.of(ddp, grpo["ddp64"]["weights"], what="GRPO LoRA weights")
        step = _step(ddp, grpo["ddp"]["initial"], lora_common.GRPO_STEPS)
        rounding.check(grpo["sharded"]["weights"], ddp, mistake=step)


def test_the_pieces_of_lora_under_sharding_that_need_no_launch(monkeypatch: pytest.MonkeyPatch):
    from lit_trainer.callbacks import HFExport, hf_export
    from lit_trainer.core import sharding as _sharding
    from lit_trainer.modules.base import _peft

    module = lora_common.sft_module()
    # FSDP2's root group is the transformers model inside the peft wrapper: peft's generate calls that model's forward
    assert _sharding.shard_root(module.model) is module.model.get_base_model()
    plain = tiny_llama(layers=1)
    assert _sharding.shard_root(plain) is plain
    _peft.check_strategy(type("ModelParallelStrategy", (), {})())  # accepted now
    with pytest.raises(ValueError, match="DeepSpeedStrategy is not supported.*ModelParallelStrategy"):
        _peft.check_strategy(type("DeepSpeedStrategy", (), {})())
    monkeypatch.setattr(hf_export, "is_sharded", lambda model: True)  # as after configure_model under FSDP2
    with pytest.raises(ValueError, match=r"merge_adapters=True.*merge_and_unload"):
        HFExport(merge_adapters=True).check_merge(module)
    HFExport().check_merge(module)  # the adapter export is gathered and written
    # the module's state_dict leaves the frozen base out once configure_model has sharded a peft model
    full = module.state_dict()
    module._adapter_only_state = True
    assert set(module.state_dict()) == {n for n, p in module.named_parameters() if p.requires_grad} < set(full)
