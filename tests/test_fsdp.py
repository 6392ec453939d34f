"""Sharded training (FSDP2 under ``ModelParallelStrategy``) on 2 CPU ranks (gloo), against one process.

One launch of ``tests/scripts/fsdp_train.py`` runs the SFT (text and vision-language), DPO, ORPO, KTO, GRPO and RLOO
fits (see its docstring); the single-process references run here, with the same global batch (per-device batch 4 on
one device = 2 per rank x 2 ranks) and accumulation, from the same initial weights, in float32.

Tolerances: the sharded float32 weights differ from the one-process float32 ones by the rounding of other reduction
orders, amplified by Adam over the steps, by an amount that depends on the machine. Each comparison is calibrated on
the machine that runs it by the same reference run in float64 (``tests/helpers/rounding.py``): the bound is a small
multiple of how far the float32 reference lands from it, and at least 100 times below one optimizer step's change.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import _fsdp_common as common  # tests/scripts
import pytest
import torch
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from helpers.rounding import FACTOR, FLOAT32_UNIT, MARGIN, Rounding, relative_l2, values
from lit_trainer.callbacks import HFExport
from lit_trainer.core import sharding as _sharding


@pytest.fixture(scope="module")
def run(ddp_world) -> Path:
    return ddp_world.part("fsdp")  # tests/scripts/fsdp_train.py, run in the shared 2-rank world


def _step_change(final: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], steps: int) -> float:
    """One optimizer step's change of the weights, on average: the size of a wrong or missing update."""
    return relative_l2(final, initial) / steps


def _sft(precision: str, callbacks: list) -> dict[str, torch.Tensor]:
    from helpers.models import tiny_llama
    from lit_trainer.modules.causal_lm import CausalLMModule

    tokenizer = ByT5Tokenizer()
    module = CausalLMModule(
        tiny_llama(seed=1, layers=2), tokenizer=tokenizer, learning_rate=1e-3, max_grad_norm=common.MAX_GRAD_NORM
    )
    trainer = common.trainer("auto", 1, common.STEPS, callbacks, precision=precision)
    trainer.fit(module, datamodule=common.sft_datamodule(tokenizer, 4))
    return common.full_weights(module)


@pytest.fixture(scope="module")
def single_sft(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The one-process SFT run in float32, and its calibration: the same run in float64."""
    from helpers.models import tiny_llama

    clip, export = common.ClipRecorder(), tmp_path_factory.mktemp("single") / "export"
    weights = _sft("32-true", [clip, HFExport(str(export))])
    initial = dict(tiny_llama(seed=1, layers=2).named_parameters())
    return SimpleNamespace(
        weights=weights,
        clip=clip,
        export=export,
        rounding=Rounding.of(weights, _sft("64-true", []), what="SFT weights"),
        step=_step_change(weights, initial, common.STEPS),
    )


@pytest.mark.ddp
def test_sft_sharded_ends_with_the_single_process_weights(run: Path, single_sft: SimpleNamespace):
    sharded = torch.load(run / "sft.pt", weights_only=False)
    assert sharded["param_type"] == "DTensor"  # really sharded
    assert len(sharded["pre"]) == common.STEPS == len(single_sft.clip.pre)
    single_sft.rounding.check(sharded["weights"], single_sft.weights, mistake=single_sft.step)


@pytest.mark.ddp
def test_activation_checkpointing_under_sharding_gives_the_same_weights(run: Path, single_sft: SimpleNamespace):
    """With gradient checkpointing AND chunked logits (``chunked_logits="on"``, 7-token chunks) on the sharded model:
    the same weights as the single-process run on full logits, within the calibrated rounding."""
    checkpointed = torch.load(run / "sft_checkpointed.pt", weights_only=False)
    single_sft.rounding.check(checkpointed, single_sft.weights, mistake=single_sft.step)


@pytest.mark.ddp
def test_vision_lora_sharded_ends_with_the_single_process_weights(run: Path):
    """tiny-vl with LoRA: the vision tower sharded with the root group (not block by block), ranks whose micro-batch
    has no image running it on a blank one; the same trainable weights as one process (calibrated in float64)."""
    from ddp_vision import fsdp_run  # tests/scripts

    sharded = torch.load(run / "vision.pt", weights_only=False)
    assert sharded["tower_types"] == {"DTensor"}  # the tower's weights are sharded at rest
    single = {precision: fsdp_run("auto", 1, 4, precision) for precision in ("32-true", "64-true")}
    weights = single["32-true"]["weights"]
    step = _step_change(weights, single["32-true"]["initial"], 2)
    Rounding.of(weights, single["64-true"]["weights"], what="vision LoRA weights").check(
        sharded["weights"], weights, mistake=step
    )


@pytest.mark.ddp
def test_max_grad_norm_is_applied_under_every_accepted_strategy(run: Path, single_sft: SimpleNamespace):
    grpo = torch.load(run / "grpo_rank0.pt", weights_only=False)
    sft = torch.load(run / "sft.pt", weights_only=False)
    records = {
        "single": (single_sft.clip.pre, single_sft.clip.post, single_sft.clip.post64, common.MAX_GRAD_NORM),
        "model_parallel": (sft["pre"], sft["post"], sft["post64"], common.MAX_GRAD_NORM),
        "grpo_model_parallel": (grpo["sharded"]["pre"], grpo["sharded"]["post"], grpo["sharded"]["post64"], 1.0),
        "grpo_ddp": (grpo["ddp"]["pre"], grpo["ddp"]["post"], grpo["ddp"]["post64"], 1.0),
    }
    for name, (pre, post, post64, max_norm) in records.items():
        assert max(pre) > max_norm, name  # clipping had something to do
        # tolerance: both norms are float32 norms of (the same, scaled) gradients, each about as far from the exact
        # norm as the stepped gradients' float32 norm is from its float64 one (measured, at least one float32 unit):
        # FACTOR x that, plus torch's clip coefficient max_norm / (norm + 1e-6) (relative 1e-6 / norm)
        scale = max(max(abs(a - b) / b for a, b in zip(post, post64, strict=True)), FLOAT32_UNIT)
        bound = FACTOR * scale + 1e-6 / max_norm
        mistake = max(pre) / max_norm - 1  # the most-clipped step left unclipped
        assert bound * MARGIN <= mistake, (name, bound, mistake)
        observed = max(abs(after / min(before, max_norm) - 1) for before, after in zip(pre, post, strict=True))
        print(f"clipping[{name}]: observed {observed:.2e}, bound {bound:.2e}, scale {scale:.2e}, mistake {mistake:.1e}")
        assert observed <= bound, (name, observed, bound)


@pytest.mark.ddp
def test_sharded_optimizer_is_fused_adamw(run: Path):
    sharded = torch.load(run / "sft.pt", weights_only=False)
    assert sharded["fused"] is True  # torch's fused AdamW kernel takes the DTensor shards


@pytest.mark.ddp
def test_sharded_export_equals_single_process_export_and_loads(run: Path, single_sft: SimpleNamespace):
    sharded = AutoModelForCausalLM.from_pretrained(run / "sft_export")
    single = AutoModelForCausalLM.from_pretrained(single_sft.export)
    a, b = sharded.state_dict(), single.state_dict()
    keys = single_sft.weights.keys()  # the trained parameters (the state dict also names the tied lm_head)
    single_sft.rounding.check({k: a[k] for k in keys}, {k: b[k] for k in keys}, mistake=single_sft.step)
    trained = torch.load(run / "sft.pt", weights_only=False)["weights"]  # the gathered weights, exactly
    assert all(torch.equal(a[name], value) for name, value in trained.items())


@pytest.mark.ddp
def test_best_checkpoint_exports_from_a_distributed_checkpoint(run: Path):
    best = torch.load(run / "best.pt", weights_only=False)
    assert Path(best["checkpoint"]).is_dir()  # ModelParallelStrategy's distributed checkpoint
    # BestCheckpoint names the folder in the incomplete-save sentinel while the strategy writes it, then removes it
    assert sorted(os.listdir(Path(best["checkpoint"]).parent)) == ["best", Path(best["checkpoint"]).name]
    exported = AutoModelForCausalLM.from_pretrained(best["export"]).state_dict()
    assert all(torch.equal(exported[name], value) for name, value in best["weights"].items())
    assert best["neftune_draws"] == 2  # NEFTune found the sharded model's embedding: one draw per micro-batch


@pytest.mark.ddp
def test_dpo_sharded_ends_with_the_single_process_weights(run: Path):
    sharded = torch.load(run / "dpo.pt", weights_only=False)
    assert sharded["ref_types"] == {"DTensor"}  # the reference is sharded like the policy, and stays so after use
    tokenizer = ByT5Tokenizer()
    single = {}
    for precision in ("32-true", "64-true"):  # float32, and float64: the calibration
        module = common.dpo_module(tokenizer)
        common.trainer("auto", 1, common.DPO_STEPS, [common.dpo_bema()], precision=precision).fit(
            module, datamodule=common.dpo_datamodule(tokenizer, 4)
        )
        single[precision] = {"weights": common.full_weights(module), "ref": common.full_weights(module, "ref_model")}
    single32, single64 = single["32-true"], single["64-true"]
    initial = dict(common.dpo_module(tokenizer).model.named_parameters())
    step = _step_change(single32["weights"], initial, common.DPO_STEPS)
    weights = Rounding.of(single32["weights"], single64["weights"], what="DPO weights")
    weights.check(sharded["weights"], single32["weights"], mistake=step)
    # BEMA(update_ref_model=True) refreshed the sharded reference shard by shard, as the one-process run did
    ref = Rounding.of(single32["ref"], single64["ref"], what="DPO reference")
    ref.check(sharded["ref"], single32["ref"], mistake=step)
    assert any(not torch.equal(sharded["ref"][k], initial[k]) for k in sharded["ref"])  # it was refreshed


@pytest.mark.ddp
@pytest.mark.parametrize("method", ["orpo", "kto"])
def test_orpo_and_kto_sharded_end_with_the_single_process_weights(run: Path, method: str):
    sharded = torch.load(run / f"{method}.pt", weights_only=False)
    if method == "kto":
        assert sharded["ref_types"] == {"DTensor"}  # the reference is sharded like the policy
    build, data = getattr(common, f"{method}_module"), getattr(common, f"{method}_datamodule", common.dpo_datamodule)
    tokenizer = ByT5Tokenizer()
    single = {}
    for precision in ("32-true", "64-true"):  # float32, and float64: the calibration
        module = build(tokenizer)
        common.trainer("auto", 1, common.DPO_STEPS, [], precision=precision).fit(module, datamodule=data(tokenizer, 4))
        single[precision] = common.full_weights(module)
    initial = dict(build(tokenizer).model.named_parameters())
    step = _step_change(single["32-true"], initial, common.DPO_STEPS)
    Rounding.of(single["32-true"], single["64-true"], what=f"{method} weights").check(
        sharded["weights"], single["32-true"], mistake=step
    )


@pytest.mark.ddp
def test_rloo_sharded_matches_ddp(run: Path):
    for r in (0, 1):
        rank = torch.load(run / f"rloo_rank{r}.pt", weights_only=False)
        assert rank["sharded"]["longest"] == rank["ddp"]["longest"] == rank["ddp64"]["longest"]  # same completions
        ddp = rank["ddp"]["weights"]
        rounding = Rounding.of(ddp, rank["ddp64"]["weights"], what="RLOO weights")  # as GRPO's, calibrated in float64
        rounding.check(rank["sharded"]["weights"], ddp, mistake=_step_change(ddp, rank["ddp"]["initial"], 4))


@pytest.mark.ddp
def test_grpo_sharded_generation_with_uneven_lengths_matches_ddp(run: Path):
    ranks = [torch.load(run / f"grpo_rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["sharded"]["longest"] != ranks[1]["sharded"]["longest"]  # ranks stopped at different lengths
    for rank in ranks:
        assert rank["sharded"]["longest"] == rank["ddp"]["longest"] == rank["ddp64"]["longest"]  # same completions
        # same data and completions; lr 1e-2 and Adam's 1/sqrt(v) on near-zero second moments amplify the float
        # rounding of the sharded reductions: calibrated by the DDP run in float64
        ddp = rank["ddp"]["weights"]
        rounding = Rounding.of(ddp, rank["ddp64"]["weights"], what="GRPO weights")
        rounding.check(rank["sharded"]["weights"], ddp, mistake=_step_change(ddp, rank["ddp"]["initial"], 4))
        # asynchronous rollouts at max_staleness=0 (each rank's own worker sampling, from the gathered weights when
        # sharded) are the synchronous run bit for bit, sharded and under DDP; every worker was stopped
        for asynchronous, synchronous in (("sharded_async", "sharded"), ("ddp_async", "ddp")):
            assert rank[asynchronous]["longest"] == rank[synchronous]["longest"]
            for name, value in rank[synchronous]["weights"].items():
                assert torch.equal(rank[asynchronous]["weights"][name], value), (asynchronous, name)
        assert rank["sharded_async"]["worker"] is None and rank["ddp_async"]["worker"] is None
        # the reference synced at step 2 (sync_ref_model) on the shards equals the DDP one, and moved off the start
        ref = rank["ddp"]["ref"]
        assert any(not torch.equal(ref[n], rank["ddp"]["initial"][n]) for n in ref)
        Rounding.of(ref, rank["ddp64"]["ref"], what="GRPO synced reference").check(
            rank["sharded"]["ref"], ref, mistake=_step_change(ref, rank["ddp"]["initial"], 4)
        )


def _fake_trainer(strategy_name: str, gradient_clip_val: float | None = None) -> SimpleNamespace:
    strategy = type(strategy_name, (), {})()
    return SimpleNamespace(strategy=strategy, gradient_clip_val=gradient_clip_val)


def test_strategies_that_would_drop_a_feature_are_refused():
    with pytest.raises(ValueError, match="FSDPStrategy.*ModelParallelStrategy"):
        _sharding.check_strategy(_fake_trainer("FSDPStrategy"), 1.0)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0.*gradient_clip_val=1.0"):
        _sharding.check_strategy(_fake_trainer("DeepSpeedStrategy"), 1.0)
    _sharding.check_strategy(_fake_trainer("DeepSpeedStrategy", 1.0), 1.0)  # DeepSpeed clips with the Trainer's
    _sharding.check_strategy(_fake_trainer("DeepSpeedStrategy"), None)
    for name in _sharding.LOCAL_GRAD_STRATEGIES:
        _sharding.check_strategy(_fake_trainer(name), 1.0)


def test_deepspeed_is_not_taken_for_ddp_though_it_subclasses_it():
    # Lightning's DeepSpeedStrategy subclasses DDPStrategy but keeps its gradients in its engine, not `param.grad`
    from lightning.pytorch.strategies import DDPStrategy

    deepspeed = type("DeepSpeedStrategy", (DDPStrategy,), {})()
    assert _sharding.has_local_grads(DDPStrategy()) and not _sharding.has_local_grads(deepspeed)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0.*gradient_clip_val=1.0"):
        _sharding.check_strategy(SimpleNamespace(strategy=deepspeed, gradient_clip_val=None), 1.0)


def test_block_classes_come_from_no_split_modules_or_the_override():
    from helpers.models import tiny_llama

    model = tiny_llama(layers=2)
    assert _sharding.block_class_names(model) == {"LlamaDecoderLayer"}
    assert _sharding.block_class_names(model, ["LlamaMLP"]) == {"LlamaMLP"}
    with pytest.raises(ValueError, match="shard_blocks=\\['Nope'\\].*LlamaDecoderLayer"):
        _sharding.block_class_names(model, ["Nope"])
    with pytest.raises(ValueError, match="shard_param_dtype='fp8'"):
        _sharding.fsdp_policies("fp8", False)


def test_slurm_variables_of_two_local_tasks_select_the_ranks(monkeypatch: pytest.MonkeyPatch):
    """What the sbatch script of docs/cluster.md relies on: under ``srun`` (2 tasks on one node) Lightning's SLURM
    environment gives each task its rank for ModelParallelStrategy, and the strategy does not spawn processes itself."""
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    # building a Trainer as task 1 sets the process-wide rank-zero flags to 1: restore them after the test, or every
    # later warning and log line of this test process would be silenced
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    monkeypatch.setattr(utils_rank_zero_only, "rank", utils_rank_zero_only.rank)
    for task in (0, 1):
        for key, value in {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task),
            "SLURM_NODEID": "0",
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NAME": "sft",
            "SLURM_NODELIST": "node1",
        }.items():
            monkeypatch.setenv(key, value)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=common.model_parallel(), logger=False)
        environment = trainer.strategy.cluster_environment
        assert isinstance(environment, SLURMEnvironment) and environment.creates_processes_externally
        assert (environment.global_rank(), environment.local_rank(), environment.world_size()) == (task, task, 2)


class _Mesh:
    """A device-mesh stand-in: named dimensions of given sizes."""

    def __init__(self, **sizes: int) -> None:
        self.sizes, self.mesh_dim_names = sizes, tuple(sizes)

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: self.sizes[name], name=name)


def test_only_the_data_parallel_dimension_is_sharded():
    assert _sharding.data_parallel_mesh(_Mesh(data_parallel=4, tensor_parallel=1)).name == "data_parallel"
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\) is not supported.*tensor_parallel_size=1"):
        _sharding.data_parallel_mesh(_Mesh(data_parallel=2, tensor_parallel=2))


@pytest.fixture(scope="module")
def single_bema_best(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process run in float32, with ``"calibration"``: the same run in float64, and ``"step"``: one step's
    change of the weights."""
    from helpers.models import tiny_llama

    single = common.bema_best_run(lambda: "auto", 1, 4, str(tmp_path_factory.mktemp("single_bema")))
    single["calibration"] = common.bema_best_run(
        lambda: "auto", 1, 4, str(tmp_path_factory.mktemp("single_bema64")), precision="64-true"
    )
    initial = {"model." + k: v for k, v in tiny_llama(seed=4, layers=2).named_parameters()}
    single["step"] = _step_change(single["after_fit"], initial, common.BEMA_STEPS)
    return single


def _bema_rounding(single: dict, key: str) -> Rounding:
    return Rounding.of(single[key], single["calibration"][key], what=f"BEMA {key}")


@pytest.mark.ddp
def test_sharded_bema_weights_and_scores_equal_the_single_process_ones(run: Path, single_bema_best: dict):
    sharded = torch.load(run / "bema_best.pt", weights_only=False)
    step = single_bema_best["step"]
    _bema_rounding(single_bema_best, "bema").check(sharded["bema"], single_bema_best["bema"], mistake=step)  # gathered
    assert len(sharded["val_losses"]) == common.BEMA_STEPS  # evaluate_with_bema: the BEMA weights were scored
    single = single_bema_best["val_losses"]
    losses = Rounding.of(values(single), values(single_bema_best["calibration"]["val_losses"]), what="val_losses")
    one_step = relative_l2(values(single[1:]), values(single[:-1]))  # how much one step moves the score
    losses.check(values(sharded["val_losses"]), values(single), mistake=one_step)
    # the state_dict holds full tensors; a fresh callback cuts its shards out of them and gathers the same weights
    assert all(torch.equal(sharded["round_trip"][k], v) for k, v in sharded["bema"].items())
    # resumed from the step-2 distributed checkpoint (rank 0's full-tensor state, each rank cutting its shards): the
    # average continues as the one-process run resumed from its step-2 checkpoint does
    _bema_rounding(single_bema_best, "resumed").check(sharded["resumed"], single_bema_best["resumed"], mistake=step)
    exported = AutoModelForCausalLM.from_pretrained(sharded["export"]).state_dict()
    assert all(torch.equal(exported[k[len("model.") :]], v) for k, v in sharded["bema"].items())


@pytest.mark.ddp
def test_sharded_best_checkpoint_loads_the_scored_weights_at_the_end(run: Path, single_bema_best: dict):
    from lit_trainer.callbacks import BEMA
    from lit_trainer.callbacks.checkpointing._files import load_checkpoint_state_dict

    sharded = torch.load(run / "bema_best.pt", weights_only=False)
    assert Path(sharded["best_path"]).is_dir()  # a distributed checkpoint
    scored = load_checkpoint_state_dict(sharded["best_path"])  # the BEMA weights validation scored
    saved_bema = BEMA.bema_weights_from_checkpoint(sharded["best_path"])  # full tensors in rank 0's callback state
    assert all(torch.equal(sharded["after_fit"][k], scored[k]) for k in sharded["after_fit"])
    assert all(torch.equal(sharded["after_fit"][k], saved_bema[k]) for k in sharded["after_fit"])
    assert sharded["best_score"] == min(sharded["val_losses"])
    # tolerance: the re-validation of the loaded best weights sums the same rows in another process layout;
    # float32 rounding of a mean of ~1e3 token losses (~1e-7 relative) vs a wrong checkpoint (> 1e-3 apart)
    assert sharded["validated"] == pytest.approx(sharded["best_score"], rel=1e-6)  # validates at the best score
    rounding = _bema_rounding(single_bema_best, "after_fit")
    rounding.check(sharded["after_fit"], single_bema_best["after_fit"], mistake=single_bema_best["step"])
