"""RunIdentity on plain Lightning (no CLI): the record is written, another module's checkpoint is refused."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_trainer.callbacks import RunIdentity
from lit_trainer.callbacks.run_identity import RECORD_KEY, identity_mismatch, pick_last


class _Net(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)


class _OtherNet(_Net):
    pass


def _trainer(tmp_path, name: str, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=CSVLogger(tmp_path, name=name, version=0),
        callbacks=[RunIdentity()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_record_is_written_and_the_same_run_resumes(tmp_path):
    first = _trainer(tmp_path, "a", 2)
    first.fit(_Net())
    ckpt = tmp_path / "a" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt"
    record = torch.load(ckpt, weights_only=True)["lit_trainer_run"]
    assert record == {
        "module": f"{__name__}._Net",
        "datamodule": None,
        "run_name": "a",
        "run_dir": str(tmp_path / "a" / "version_0"),
        "config": {"model.lr": 0.1, "data": "{}"},  # the module's hparams; no data module
        "global_step": 2,
        "finished": True,  # max_steps=2 reached
    }
    again = _trainer(tmp_path, "a", 3)
    again.fit(_Net(), ckpt_path=ckpt)
    assert again.global_step == 3


def test_a_changed_hyperparameter_is_named_in_a_warning_and_used(tmp_path):
    _trainer(tmp_path, "a", 2).fit(_Net())
    ckpt = tmp_path / "a" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt"
    with pytest.warns(UserWarning, match=r"changed configuration \(model.lr: checkpoint 0.1, this run 0.5\)"):
        _trainer(tmp_path, "a", 3).fit(_Net(lr=0.5), ckpt_path=ckpt)


@pytest.mark.parametrize(
    ("limits", "finished"), [({"max_steps": 3}, [False, False, True]), ({"max_epochs": 1}, [True])]
)
def test_finished_is_true_only_for_a_checkpoint_written_at_the_runs_limit(tmp_path, limits, finished):
    every = {"every_n_train_steps": 1} if "max_steps" in limits else {}
    trainer = L.Trainer(
        accelerator="cpu",
        **limits,
        logger=False,
        callbacks=[RunIdentity(), ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, **every)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Net())  # 4 batches per epoch
    saved = sorted(tmp_path.glob("*.ckpt"), key=lambda p: torch.load(p, weights_only=True)["global_step"])
    assert [torch.load(p, weights_only=True)["lit_trainer_run"]["finished"] for p in saved] == finished


def _record_file(path: Path, record: dict) -> str:
    torch.save({RECORD_KEY: record}, path)
    return str(path)


def test_pick_last_takes_each_run_by_its_newest_checkpoint_and_skips_other_or_finished_runs(tmp_path):
    current = {"module": "m.A", "datamodule": "d.D", "run_name": "sft", "config": {"model.init_args.lr": 0.1}}
    same = {**current, "finished": False}
    for run in ("v0", "v1", "v2", "v3"):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
    v0_config = {"model.init_args.lr": 0.1, "data.init_args.num_workers": 4}
    newest_first = [
        # v3: newest, another learning rate
        _record_file(tmp_path / "v3/checkpoints/last.ckpt", {**same, "config": {"model.init_args.lr": 0.2}}),
        # v2: finished; its older periodic checkpoint must not be taken for the run's state
        _record_file(tmp_path / "v2/checkpoints/last.ckpt", {**same, "finished": True, "global_step": 20}),
        _record_file(tmp_path / "v2/checkpoints/step=10.ckpt", same),
        # v1: another module class
        _record_file(tmp_path / "v1/checkpoints/last.ckpt", {**same, "module": "m.B"}),
        # v0: the same run, unfinished; a data-loading option differs, which a resume may change
        _record_file(tmp_path / "v0/checkpoints/jit.ckpt", {**same, "config": v0_config}),
    ]
    path, skipped = pick_last(newest_first, current)
    assert path == newest_first[-1]
    assert [(Path(p).parent.parent.name, reason.split(" (")[0].split(":")[0]) for p, reason in skipped] == [
        ("v3", "its configuration differs"),
        ("v2", "that run finished"),
        ("v1", "it belongs to another run"),
    ]
    assert "model.init_args.lr: checkpoint 0.2, this run 0.1" in skipped[0][1]
    assert pick_last(newest_first[:3], current)[0] is None


def test_another_module_class_or_run_name_is_refused(tmp_path):
    _trainer(tmp_path, "a", 2).fit(_Net())
    ckpt = tmp_path / "a" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt"
    with pytest.raises(ValueError, match=r"module: checkpoint '.*\._Net', this run '.*\._OtherNet'"):
        _trainer(tmp_path, "a", 3).fit(_OtherNet(), ckpt_path=ckpt)
    with pytest.raises(ValueError, match=r"run_name: checkpoint 'a', this run 'b'"):
        _trainer(tmp_path, "b", 3).fit(_Net(), ckpt_path=ckpt)


def test_a_checkpoint_without_record_loads_with_a_warning(tmp_path):
    _trainer(tmp_path, "a", 2).fit(_Net())
    ckpt = tmp_path / "a" / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt"
    state = torch.load(ckpt, weights_only=False)
    del state["lit_trainer_run"]
    torch.save(state, tmp_path / "plain.ckpt")
    with pytest.warns(UserWarning, match="has no lit_trainer run record"):
        _trainer(tmp_path, "a", 3).fit(_Net(), ckpt_path=tmp_path / "plain.ckpt")


def test_a_class_recorded_under_a_former_path_is_the_same_run(tmp_path):
    # A class that moved to another file stays importable from its former path, and checkpoints written before the
    # move record that path. `lit_trainer.GRPOModule` stands for the former path here: it imports to the same class.
    # Checked where a fit loads a checkpoint (identity_mismatch) and where `--ckpt_path last` picks one (pick_last),
    # for the recorded module and for the configuration's `model.class_path`.
    path = "lit_trainer.modules.grpo.GRPOModule"
    current = {"module": path, "datamodule": None, "run_name": "grpo", "config": {"model.class_path": path}}
    former = {**current, "module": "lit_trainer.GRPOModule", "finished": False}
    assert identity_mismatch(former, current, "x.ckpt") is None
    former_config = {**former, "module": path, "config": {"model.class_path": "lit_trainer.GRPOModule"}}
    rloo = {**former, "module": "lit_trainer.RLOOModule"}
    files = []
    for run, record in (("v2", rloo), ("v1", former_config), ("v0", former)):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        files.append(_record_file(tmp_path / run / "checkpoints" / "last.ckpt", record))
    assert pick_last(files[1:], current) == (files[1], [])
    assert pick_last(files[2:], current) == (files[2], [])
    assert identity_mismatch(rloo, current, "x.ckpt") is not None  # another class is still another run
    assert pick_last(files[:1], current)[0] is None
