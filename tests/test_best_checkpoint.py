"""BestCheckpoint callback (+ the atomic-write helper): scripted metrics, rotation, load-best, HF export, resume,
crash safety, DDP agreement (2 processes), CLI, and the three reusable callbacks used together."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

import helpers.modules
from helpers.cli import cli_with_callback
from helpers.data import regression_data
from helpers.modules import TinyHF, TinyLM
from lit_trainer.callbacks.checkpointing import BestCheckpoint
from lit_trainer.callbacks.eval_on_start import EvalOnStart
from lit_trainer.callbacks.neftune import NEFTune
from lit_trainer.core import atomic as _atomic

# scripted monitored values by optimizer step: improves, worsens, NaN, improves, ties, worsens, improves, improves
SCORES = {2: 3.0, 4: 4.0, 6: math.nan, 8: 2.0, 10: 2.0, 12: 5.0, 14: 1.5, 16: 1.0}


class Regressor(helpers.modules.Regressor):
    """The tests' regression MLP, also logging a scripted `val_score`."""

    def validation_step(self, batch, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("val_score", SCORES[self.global_step])


class WeightsAtTrainEnd(Callback):
    """Runs before checkpoint callbacks (Lightning moves those last): the weights before load_best_at_end."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


def _trainer(tmp_path: Path, callbacks: list, max_steps: int, **kw) -> pl.Trainer:
    base = dict(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    return pl.Trainer(callbacks=callbacks, **{**base, **kw})


def _fit(trainer: pl.Trainer, model: pl.LightningModule, **kw) -> None:
    trainer.fit(
        model, DataLoader(regression_data(0, 64), batch_size=4), DataLoader(regression_data(1, 64), batch_size=16), **kw
    )


def _ckpt_state(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.parametrize("limit", [None, 1])
def test_scripted_metric_saves_only_improvements_and_loads_best(tmp_path: Path, limit: int | None) -> None:
    pl.seed_everything(0)
    before = WeightsAtTrainEnd()
    cb = BestCheckpoint(
        dirpath=tmp_path / "ckpt",
        filename="{step}",
        monitor="val_score",
        mode="min",
        save_total_limit=limit,
        load_best_at_end=True,
    )
    model = Regressor()
    _fit(_trainer(tmp_path, [before, cb], max_steps=10), model)
    # steps 2 (3.0: first), 4 (4.0: worse), 6 (NaN: never), 8 (2.0: better), 10 (2.0: a tie is no improvement)
    expected = ["step=2.ckpt", "step=8.ckpt"] if limit is None else ["step=8.ckpt"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == expected  # no partial files either
    assert cb.best_model_path == str(tmp_path / "ckpt" / "step=8.ckpt") and float(cb.best_model_score) == 2.0
    assert list(cb.best_k_models) == [str(tmp_path / "ckpt" / name) for name in expected]
    best = _ckpt_state(cb.best_model_path)
    final = model.state_dict()
    assert all(torch.equal(final[k], best[k]) for k in best)  # load_best_at_end
    assert any(not torch.equal(before.weights[k], best[k]) for k in best)  # 2 more steps were trained after step 8
    assert all(isinstance(v, (str, int, float, dict, torch.Tensor, type(None))) for v in cb.state_dict().values())


def test_resume_restores_best_and_rotation_never_deletes_the_best(tmp_path: Path) -> None:
    pl.seed_everything(0)
    dirpath = tmp_path / "ckpt"
    first = _trainer(
        tmp_path, [BestCheckpoint(dirpath=dirpath, filename="{step}", monitor="val_score", mode="min")], max_steps=8
    )
    _fit(first, Regressor())
    first.save_checkpoint(tmp_path / "resume.ckpt")
    assert sorted(os.listdir(dirpath)) == ["step=2.ckpt", "step=8.ckpt"]
    cb = BestCheckpoint(dirpath=dirpath, filename="{step}", monitor="val_score", mode="min", save_total_limit=2)
    _fit(_trainer(tmp_path, [cb], max_steps=16), Regressor(), ckpt_path=tmp_path / "resume.ckpt")
    # restored best 2.0 (step 8): 10 (2.0 tie) and 12 (5.0) are not saved; 14 (1.5) is saved and rotation drops
    # the oldest (step 2); 16 (1.0) is saved and drops step 8 (no longer the best)
    assert sorted(os.listdir(dirpath)) == ["step=14.ckpt", "step=16.ckpt"]
    assert float(cb.best_model_score) == 1.0 and cb.best_model_path.endswith("step=16.ckpt")


class Killed(Exception):
    """The process died here (a kill runs no cleanup; a write that fails with an OSError removes its partial file,
    tests/test_disk_full.py)."""


class CrashingIO(TorchCheckpointIO):
    """Writes half a file, then dies, like a process killed mid-save."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"PK\x03\x04 truncated")
        raise Killed("simulated mid-save crash")


def test_crash_mid_save_leaves_no_file_with_a_complete_name(tmp_path: Path) -> None:
    cb = BestCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", monitor="val_score", mode="min")
    trainer = _trainer(tmp_path, [cb], max_steps=4, plugins=[CrashingIO()])
    with pytest.raises(Killed, match="simulated"):
        _fit(trainer, Regressor())
    names = os.listdir(tmp_path / "ckpt")
    assert names == [".step=2.ckpt.partial"] and all(_atomic.is_partial(n) for n in names)
    assert _atomic.remove_partials(tmp_path / "ckpt") and os.listdir(tmp_path / "ckpt") == []


def test_atomic_helpers(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), _atomic.atomic_write(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    folder = tmp_path / "best"
    for content in ("v1", "v2"):
        with _atomic.atomic_directory(folder) as tmp:
            (tmp / "weights").write_text(content)
            assert not (folder / "weights").exists() or (folder / "weights").read_text() == "v1"
    assert (folder / "weights").read_text() == "v2" and sorted(os.listdir(tmp_path)) == ["best", "f.bin"]
    assert _atomic.partial_path(folder).name == ".best.partial" and not _atomic.is_partial(folder)
    assert _atomic.is_local_path(tmp_path) and not _atomic.is_local_path("s3://bucket/x.ckpt")


class TinyHFModule(TinyHF):
    """The tests' module around a tiny Llama, with a tokenizer as `.tokenizer`, logging a scripted `val_score`."""

    def __init__(self) -> None:
        import transformers

        super().__init__(lr=1e-2, optimizer="adamw", seed=None)
        self.tokenizer = transformers.ByT5Tokenizer()

    def validation_step(self, batch, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("val_score", SCORES[self.global_step])


def test_export_hf_writes_the_best_model_loadable_by_from_pretrained(tmp_path: Path) -> None:
    import transformers

    pl.seed_everything(0)
    module = TinyHFModule()
    ids = torch.randint(3, 259, (16, 12), generator=torch.Generator().manual_seed(0))
    cb = BestCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", monitor="val_score", mode="min", export_hf=True)
    trainer = _trainer(tmp_path, [cb], max_steps=6)
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=4), DataLoader(TensorDataset(ids[:4]), batch_size=4))
    # scores 3.0 at step 2 (best), 4.0, NaN: the export is step 2's weights although training went on to step 6
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["best", "step=2.ckpt"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "best")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "ckpt" / "best")
    assert type(tokenizer).__name__ == "ByT5Tokenizer" and tokenizer("7+5=").input_ids == [58, 46, 56, 64, 1]
    best = {k[len("model.") :]: v for k, v in _ckpt_state(tmp_path / "ckpt" / "step=2.ckpt").items()}
    exported = loaded.state_dict()
    assert set(exported) == set(best) and all(torch.equal(exported[k], best[k]) for k in best)
    assert not torch.equal(module.model.lm_head.weight.detach(), best["lm_head.weight"])


def test_validation_errors(tmp_path: Path) -> None:
    for limit in (0, -1):
        with pytest.raises(ValueError, match=f"save_total_limit={limit}"):
            BestCheckpoint(save_total_limit=limit)
    with pytest.raises(ValueError, match="mode='avg'"):
        BestCheckpoint(mode="avg")  # type: ignore[arg-type]
    assert BestCheckpoint(monitor="eval_loss").mode == "min" and BestCheckpoint(monitor="accuracy").mode == "max"
    with pytest.raises(ValueError, match=r"needs `Regressor.model` with a `save_pretrained`"):
        _fit(_trainer(tmp_path, [BestCheckpoint(monitor="val_score", export_hf=True)], max_steps=2), Regressor())


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
@pytest.mark.parametrize("monitor", [None, ""])
def test_monitor_none_is_refused_with_the_value_and_the_fix(package: str, monitor: str | None) -> None:
    # ModelCheckpoint(monitor=None) keeps the last checkpoint; a best checkpoint needs a score: one clear error
    from lit_trainer.callbacks import pytorch_lightning as plc

    cls = BestCheckpoint if package == "lightning.pytorch" else plc.BestCheckpoint
    with pytest.raises(ValueError, match=rf"`BestCheckpoint\(monitor={monitor!r}\)` is invalid") as info:
        cls(monitor=monitor)
    assert "monitor='val_loss'" in str(info.value) and "ModelCheckpoint(monitor=None)" in str(info.value)


def test_configurable_from_lightning_cli() -> None:
    def parse(init_args: dict) -> LightningCLI:
        return cli_with_callback(Regressor, "lit_trainer.callbacks.checkpointing.BestCheckpoint", init_args)

    cli = parse({"monitor": "val_score", "mode": "max", "save_total_limit": 2, "load_best_at_end": True})
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, BestCheckpoint)]
    assert (cb.monitor, cb.mode, cb.save_total_limit, cb.load_best_at_end, cb.export_hf) == (
        "val_score",
        "max",
        2,
        True,
        False,
    )
    with pytest.raises(SystemExit):  # Literal["min", "max"] is checked when the config is parsed
        parse({"monitor": "val_score", "mode": "avg"})


def test_three_callbacks_together(tmp_path: Path) -> None:
    pl.seed_everything(0)
    ids = torch.randint(0, 16, (32, 6), generator=torch.Generator().manual_seed(0))
    model = TinyLM(lr=0.5, optimizer="sgd", record_noise=True)
    cb = BestCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", save_total_limit=1, load_best_at_end=True)
    trainer = _trainer(
        tmp_path, [NEFTune(noise_alpha=5.0), EvalOnStart(), cb], max_steps=6, logger=CSVLogger(tmp_path, name="csv")
    )
    trainer.fit(model, DataLoader(TensorDataset(ids), batch_size=4), DataLoader(TensorDataset(ids), batch_size=8))
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [line.split(",") for line in f.read().splitlines()]
    header = rows[0]
    val_steps = [int(r[header.index("step")]) for r in rows[1:] if r[header.index("val_loss")]]
    assert val_steps == [0, 1, 3, 5]  # the start evaluation, then after steps 2, 4, 6
    assert len(model.seen["train"]) == 6 and all(0 < v <= 5 / math.sqrt(6 * 8) + 1e-6 for v in model.seen["train"])
    assert model.seen["val"] and not any(model.seen["val"])  # no noise in validation
    assert not model.embed._forward_hooks
    names = os.listdir(tmp_path / "ckpt")
    assert len(names) == 1 and names[0] != "step=0.ckpt" and cb.best_model_path.endswith(names[0])
    best = _ckpt_state(cb.best_model_path)
    assert all(torch.equal(model.state_dict()[k], best[k]) for k in best)


@pytest.mark.ddp
def test_ddp_two_processes_agree(ddp_world) -> None:
    out = ddp_world.part("best_checkpoint")  # tests/scripts/ddp_best_checkpoint.py
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    weights = [torch.load(out / f"rank{r}_weights.pt", weights_only=True) for r in (0, 1)]
    # rank 0 logs 3, 4, 2, 5 (steps 2..8) and rank 1 logs 1, 0, 9, 0 without sync_dist: rank 0's values decide,
    # so both ranks keep step=6 (2.0) as the best, and save_total_limit=1 leaves only it
    for info in ranks:
        assert info["best_model_path"].endswith("step=6.ckpt") and info["best_model_score"] == 2.0
        assert info["best_k_models"] == [ranks[0]["best_model_path"]]
        assert info["files"] == ["step=6.ckpt"]
        assert info["start_eval_steps"] == [0]  # EvalOnStart ran on both ranks, before any step
        assert info["hooks_left"] == 0 and info["noise_max"] > 0  # NEFTune noised training, then detached
    best = _ckpt_state(ranks[0]["best_model_path"])
    for w in weights:  # load_best_at_end on every rank
        assert all(torch.equal(w[k], best[k]) for k in best)
    first_noise = [torch.load(out / f"rank{r}_noise.pt", weights_only=True) for r in (0, 1)]
    assert not torch.equal(first_noise[0], first_noise[1])  # ranks draw different noise


def test_verbose_names_each_decision_with_its_score(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pl.seed_everything(0)
    cb = BestCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", monitor="val_score", mode="min", verbose=True)
    with caplog.at_level("INFO"):
        _fit(_trainer(tmp_path, [cb], max_steps=16), Regressor())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("BestCheckpoint: step")]
    new_best = [line.split("new best val_score=")[1].split(",")[0] for line in lines if "new best" in line]
    assert new_best == ["3", "2", "1.5", "1"]  # steps 2, 8, 14, 16
    assert sum("did not improve" in line for line in lines) == 4  # steps 4, 6 (NaN), 10 (tie), 12
