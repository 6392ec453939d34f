"""Every callback under `pytorch_lightning.Trainer` (`import pytorch_lightning as pl`, as Lightning's tutorials do),
on a plain `pytorch_lightning.LightningModule` with plain DataLoaders: the behaviour, not only the absence of a crash.
"""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

pl = pytest.importorskip("pytorch_lightning")  # the test extra installs it; the lightning-only tests live elsewhere

import lit_trainer.callbacks as lightning_callbacks  # noqa: E402
from helpers.cli import cli_with_callback  # noqa: E402
from helpers.modules import TinyHF, TinyLM, on_pytorch_lightning  # noqa: E402
from lit_trainer.callbacks import pytorch_lightning as plc  # noqa: E402
from lit_trainer.core.lightning_namespace import twin  # noqa: E402
from lit_trainer.data.loader import TrainLoader  # noqa: E402
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler  # noqa: E402

NAMES = ["BEMA", "BestCheckpoint", "CurvesPlot", "EvalOnStart", "ExactResume", "HFExport", "JITCheckpoint", "NEFTune"]


class Regressor(pl.LightningModule):
    """A user's module written against `pytorch_lightning` (dropout: the RNG matters for resume).

    Not `helpers.modules.Regressor`: an embedding regressor, so NEFTune has an input embedding to noise, and it
    counts its training forwards (a refused callback must stop the fit before any).
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(8, 4)
        self.net = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
        self.forwards = 0

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def _loss(self, batch) -> torch.Tensor:
        self.forwards += int(self.training)
        ids, y = (batch["ids"], batch["y"]) if isinstance(batch, dict) else batch
        return torch.nn.functional.mse_loss(self.net(self.embed(ids)).mean(1).squeeze(-1), y)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 8, (24, 3), generator=g), torch.randn(24, generator=g)
    return DataLoader(TensorDataset(ids[:8], y[:8]), batch_size=4), DataLoader(TensorDataset(ids[8:], y[8:]), 16)


def _trainer(root: Path, callbacks: list, max_steps: int = 8, **kw) -> pl.Trainer:
    base = dict(
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        accelerator="cpu",
    )
    return pl.Trainer(callbacks=callbacks, **{**base, **kw})


def _val_loss(module: pl.LightningModule, val: DataLoader) -> float:
    return pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").validate(
        module, val, verbose=False
    )[0]["val_loss"]


def test_each_namespace_gets_its_own_classes() -> None:
    for name in NAMES:
        ours, theirs = getattr(lightning_callbacks, name), getattr(plc, name)
        assert issubclass(ours, L.Callback) and not issubclass(ours, pl.Callback), name
        assert issubclass(theirs, pl.Callback) and not issubclass(theirs, L.Callback), name
        assert theirs.__init__ is ours.__init__ and theirs.__doc__ == ours.__doc__, name
    assert issubclass(plc.BestCheckpoint, pl.callbacks.ModelCheckpoint)

    class Bad(lightning_callbacks.HFExport):
        def extra(self) -> None: ...

    with pytest.raises(TypeError, match=r"Bad defines \['extra'\] itself; move them to its implementation class"):
        twin(Bad, "pytorch_lightning", __name__)


@pytest.mark.parametrize("with_bema", [False, True], ids=["alone", "with_bema"])
def test_best_checkpoint_is_the_trainers_checkpoint_and_the_best_weights_are_loaded(
    tmp_path: Path, with_bema: bool
) -> None:
    train, val = _loaders()
    best = plc.BestCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", monitor="val_loss", load_best_at_end=True)
    bema = [plc.BEMA(update_freq=1, lag=1.0, evaluate_with_bema=True, export_hf=False)] if with_bema else []
    trainer = _trainer(tmp_path, [*bema, best], max_steps=12)
    module = Regressor()
    trainer.fit(module, train, val)
    assert trainer.checkpoint_callback is best
    assert [cb for cb in trainer.callbacks if isinstance(cb, pl.callbacks.Checkpoint)] == [best]
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "checkpoints").exists()
    assert not best.best_model_path.endswith("step=12.ckpt")  # so the final weights are not the best ones
    assert _val_loss(module, val) == pytest.approx(float(best.best_model_score), rel=1e-5)


def test_eval_on_start_logs_step0_and_no_checkpoint_sees_it(tmp_path: Path) -> None:
    train, val = _loaders()
    initial = _val_loss(Regressor(), val)
    saver = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{step}", monitor="val_loss", save_top_k=-1
    )
    logger = pl.loggers.CSVLogger(tmp_path, name="csv")
    _trainer(tmp_path, [plc.EvalOnStart(), saver], max_steps=4, logger=logger).fit(Regressor(), train, val)
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = {int(r["step"]): float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")}
    assert rows[0] == pytest.approx(initial, rel=1e-6)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step=2.ckpt", "step=4.ckpt"]  # none at step 0


def test_neftune_noises_training_forwards_only_while_fitting(tmp_path: Path) -> None:
    train, val = _loaders()
    neftune, module = plc.NEFTune(noise_alpha=5.0, seed=3), Regressor()
    attached = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            attached.append(neftune.is_attached)

    _trainer(tmp_path, [neftune, Probe()], max_steps=4, limit_val_batches=0).fit(module, train, val)
    assert attached == [True] * 4 and not neftune.is_attached
    assert neftune.state_dict()["draws"] == module.forwards == 4
    clean = module.embed(torch.tensor([[1, 2, 3]]))
    assert torch.equal(module.embed(torch.tensor([[1, 2, 3]])), clean)  # no hook left: the same lookup, exact


def _resume_run(root: Path, ckpt: Path | None, max_steps: int, extra: list) -> Regressor:
    # a stateful, shuffled loader: what ExactResume needs to resume mid-epoch (a plain DataLoader replays the epoch)
    rows = [{"ids": ids, "y": y} for ids, y in _loaders()[1].dataset]
    train = TrainLoader(rows, ShardedBatchSampler(len(rows), 4, seed=3), default_collate)
    pl.seed_everything(0)
    module = Regressor()
    _trainer(root, [plc.ExactResume(), *extra], max_steps=max_steps, limit_val_batches=0).fit(
        module, train, ckpt_path=ckpt
    )
    return module


def test_exact_resume_restores_the_dropout_stream(tmp_path: Path) -> None:
    full = _resume_run(tmp_path / "a", None, 6, [])
    saver = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1
    )
    _resume_run(tmp_path / "b", None, 3, [saver])
    resumed = _resume_run(tmp_path / "c", tmp_path / "ckpt" / "step=3.ckpt", 6, [])
    for name, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)


def test_jit_checkpoint_saves_on_sigterm_and_stops(tmp_path: Path) -> None:
    train, val = _loaders()

    class SendSigterm(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    jit = plc.JITCheckpoint(dirpath=tmp_path / "jit", kill_wait=0, exit_code=None)
    previous = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path, [jit, SendSigterm()], max_steps=8, limit_val_batches=0)
    trainer.fit(Regressor(), train, val)
    assert signal.getsignal(signal.SIGTERM) == previous and trainer.global_step == 4
    ckpt = torch.load(jit.checkpoint_path, weights_only=True)
    assert ckpt["global_step"] == 4 and Path(jit.checkpoint_path).parent == tmp_path / "jit"


def test_hf_export_writes_the_trained_model_and_refuses_a_plain_module(tmp_path: Path) -> None:
    import transformers

    ids = DataLoader(TensorDataset(torch.randint(1, 32, (8, 6), generator=torch.Generator().manual_seed(0))), 4)
    module = on_pytorch_lightning(TinyHF)(vocab=32, hidden=8, positions=16, tie=False, seed=None)
    _trainer(tmp_path, [plc.HFExport(dirpath=tmp_path / "hf")], max_steps=2, enable_checkpointing=False).fit(
        module, ids
    )
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)
    plain = Regressor()
    with pytest.raises(TypeError, match="HFExport needs `Regressor.model`"):
        _trainer(tmp_path, [plc.HFExport(dirpath=tmp_path / "hf2")], enable_checkpointing=False).fit(plain, ids)
    assert plain.forwards == 0


def test_curves_plot_draws_from_a_pytorch_lightning_csv_logger(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    train, val = _loaders()
    plot = plc.CurvesPlot()
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    _trainer(tmp_path, [plot], max_steps=4, logger=logger, log_every_n_steps=1, val_check_interval=2).fit(
        Regressor(), train, val
    )
    assert plot.path == os.path.join(logger.log_dir, "curves.png") and os.path.isfile(plot.path)
    assert plot.panels == ["loss"]  # this module logs val_loss only: the loss panel


def test_configurable_from_a_pytorch_lightning_cli() -> None:
    from pytorch_lightning.cli import LightningCLI

    cli = cli_with_callback(
        Regressor,
        "lit_trainer.callbacks.pytorch_lightning.BestCheckpoint",
        {"monitor": "val_loss", "save_total_limit": 2},
        cli=LightningCLI,
    )
    assert isinstance(cli.trainer.checkpoint_callback, plc.BestCheckpoint)
    assert cli.trainer.checkpoint_callback.save_total_limit == 2


@pytest.mark.parametrize("name", NAMES)
def test_a_callback_of_the_other_package_is_refused_with_the_import_to_use(tmp_path: Path, name: str) -> None:
    args = {"NEFTune": {"noise_alpha": 1.0}}.get(name, {})
    train, val = _loaders()
    module = Regressor()
    with pytest.raises(
        TypeError,
        match=r"is a `lightning.pytorch` callback.*import it from "
        r"`lit_trainer.callbacks.pytorch_lightning`",
    ):
        _trainer(tmp_path, [getattr(lightning_callbacks, name)(**args)]).fit(module, train, val)
    with pytest.raises(TypeError, match=r"is a `pytorch_lightning` callback.*import it from `lit_trainer.callbacks`"):
        L.Trainer(
            callbacks=[getattr(plc, name)(**args)],
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            default_root_dir=tmp_path,
        ).fit(TinyLM(), train, val)
    assert module.forwards == 0
