"""What the CLI says: parse errors (ours first, did-you-mean), negative numbers, progress lines, the final table,
the CPU-oversubscription decision, the run-folder rules, and the targeted noise filters."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_trainer.callbacks.progress import RunProgressBar, format_metrics, metrics_table, render_text
from lit_trainer.callbacks.run_identity import identity_mismatch
from lit_trainer.cli.app import LitTrainerCLI, unbounded_run_error
from lit_trainer.cli.cpu_threads import oversubscription_warning
from lit_trainer.cli.errors import join_negative_numbers, lead_message, suggest
from lit_trainer.cli.noise import only_frozen_modules_in_eval_mode, quiet_startup_noise
from lit_trainer.cli.runs import default_run_name, fresh_version, version_of

SFT = str(Path(__file__).resolve().parents[1] / "configs" / "sft.yaml")


def _error(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        LitTrainerCLI(args=["fit", "--config", SFT, *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--model.init_args.learnin_rate", "1e-3"],
            "error: model (lit_trainer.CausalLMModule): Option 'learnin_rate' is not accepted "
            "(did you mean 'learning_rate'?)",
        ),
        (["--model.init_args.scheduler", "cosin"], "Got value: cosin (did you mean 'cosine'?)"),
        (
            ["--trainer.max_stepz", "3"],
            "unrecognized arguments: --trainer.max_stepz 3 (did you mean '--trainer.max_steps'?)",
        ),
    ],
)
def test_parse_errors_lead_with_the_problem_and_suggest_the_close_name(args, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _error(args, capsys)
    assert expected in err
    assert "Union subtypes" not in err and "Given value" not in err and "NestedArg" not in err
    assert len(err.splitlines()) <= 4  # no page of usage before the error


def test_our_validation_message_comes_out_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as refused:
        LitTrainerCLI(
            args=["fit", "--config", SFT, "--model.init_args.learning_rate", "-1", "--trainer.max_steps", "1"]
        )
    assert str(refused.value).startswith("`learning_rate=-1.0`") and "Union" not in str(refused.value)
    with pytest.raises(ValueError) as refused:  # only the bad value is named
        LitTrainerCLI(
            args=["fit", "--config", SFT, "--model.init_args.weight_decay", "-0.1", "--trainer.max_steps", "1"]
        )
    assert str(refused.value).startswith("`weight_decay=-0.1`") and "learning_rate" not in str(refused.value)


def test_negative_numbers_parse_without_the_equals_form(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert join_negative_numbers(["--a", "-1e-3", "--b", "-2", "--c=-3", "--d", "x"]) == [
        "--a=-1e-3",
        "--b=-2",
        "--c=-3",
        "--d",
        "x",
    ]
    with pytest.raises(SystemExit):
        LitTrainerCLI(args=["fit", "--config", SFT, "--model.init_args.learning_rate", "-1e-3", "--print_config"])
    assert "learning_rate: -0.001" in capsys.readouterr().out
    assert "'=' form" in suggest("argument --model: expected one argument")


def test_lead_message_keeps_only_the_given_class_errors():
    text = (
        "Does not validate against any of the Union subtypes\nSubtypes: [A, None]\nErrors:\n"
        "  - `beta=-1`: must be > 0.\n  - Expected a <class 'NoneType'>\nGiven value type: x\nGiven value: y"
    )
    assert lead_message(text) == "`beta=-1`: must be > 0."
    assert lead_message("plain message") == "plain message"


@pytest.mark.parametrize(
    ("steps", "epochs", "time", "bounded"),
    [
        (1500, None, None, True),
        (-1, 3, None, True),
        (-1, -1, "00:01:00:00", True),
        (-1, -1, None, False),
        (-1, None, None, False),
        (None, None, None, False),
    ],
)
def test_unbounded_run_decision(steps, epochs, time, bounded):
    assert (unbounded_run_error(steps, epochs, time) is None) == bounded


def test_oversubscription_decision():
    assert oversubscription_warning(2, 1, 9.0, 1.0) is None  # one thread: nothing to stall
    assert oversubscription_warning(2, 2, 2.4, 0.1) is None  # busy but within the margin (our own two threads)
    message = oversubscription_warning(2, 2, 3.1, 0.7)
    assert message and "OMP_NUM_THREADS=1" in message and "torch.set_num_threads(1)" in message
    assert "2 threads on 2 cores" in message and "3.1" in message
    assert oversubscription_warning(16, 16, 12.0, 0.1) is None


def test_progress_text():
    assert format_metrics({"train_loss": torch.tensor(1.23456), "lr": 0.003}) == "train_loss 1.235 | lr 0.003"
    assert render_text(metrics_table({"val_loss": 0.5, "val_exact_match": 0.956}), 80).splitlines() == [
        "  val_exact_match  0.956",
        "  val_loss         0.5",
    ]


@pytest.mark.parametrize(("max_epochs", "expected"), [(-1, "Epoch 0"), (None, "Epoch 0"), (3, "Epoch 0/2")])
def test_rich_bar_has_no_negative_epoch_total(max_epochs, expected):
    bar = RunProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs)
    assert bar._get_train_description(0).strip() == expected


def test_run_folder_rules(tmp_path):
    assert [default_run_name(p) for p in ("lit_trainer.CausalLMModule", "a.DPOModule", "b.GRPOModule", "c.MyNet")] == [
        "sft",
        "dpo",
        "grpo",
        "mynet",
    ]
    run_root = tmp_path / "sft"
    assert fresh_version(run_root, None) == (0, None)
    (run_root / "version_0").mkdir(parents=True)
    assert fresh_version(run_root, 0) == (0, None)  # pinned and empty: used
    (run_root / "version_0" / "metrics.csv").write_text("step\n")
    version, note = fresh_version(run_root, 0)
    assert version == 1 and "version_0 already holds an earlier run" in note and "version_1" in note
    ckpt = run_root / "version_0" / "checkpoints" / "last.ckpt"
    assert version_of(ckpt, run_root) == 0
    assert version_of(tmp_path / "elsewhere" / "x.ckpt", run_root) is None
    assert version_of(tmp_path / "elsewhere" / "x.ckpt", run_root, run_dir=str(run_root / "version_3")) == 3


def test_identity_mismatch_names_both_sides():
    sft = {"module": "m.CausalLMModule", "datamodule": "d.SFTDataModule", "run_name": "sft", "run_dir": "a"}
    assert identity_mismatch(sft, {**sft, "run_dir": "b"}, "x.ckpt") is None  # the folder may move
    message = identity_mismatch({**sft, "module": "m.GRPOModule"}, sft, "x.ckpt")
    assert "module: checkpoint 'm.GRPOModule', this run 'm.CausalLMModule'" in message and "x.ckpt" in message


def test_noise_filters_are_targeted(caplog):
    quiet_startup_noise()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_startup_noise()  # re-install inside the recording context
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("some other deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["some other deprecation"]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("💡 Tip: ... try installing [litlogger](https://pypi.org/project/litlogger/) ...")
        logger.info("GPU available: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False"]
    frozen = torch.nn.Linear(2, 2).requires_grad_(False).eval()
    assert only_frozen_modules_in_eval_mode(torch.nn.Sequential(torch.nn.Linear(2, 2), frozen))
    assert not only_frozen_modules_in_eval_mode(torch.nn.Sequential(torch.nn.Linear(2, 2).eval()))
    assert not only_frozen_modules_in_eval_mode(torch.nn.Linear(2, 2))


def test_library_progress_bars_are_off_only_off_a_terminal():
    import io

    import datasets
    import transformers

    from lit_trainer.cli.noise import quiet_progress_bars_off_terminal

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def enabled() -> tuple[bool, bool]:
        return datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled()

    datasets.enable_progress_bars()
    transformers.utils.logging.enable_progress_bar()
    try:
        assert not quiet_progress_bars_off_terminal(Terminal()) and enabled() == (True, True)
        assert quiet_progress_bars_off_terminal(io.StringIO()) and enabled() == (False, False)
    finally:
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()


def test_plain_progress_lines_show_the_values_of_their_own_step(capsys, tmp_path):
    """Lightning runs the callbacks' ``on_train_batch_end`` before the module's, where a step's window is logged: a line
    printed there would show the previous window's values. Each line must carry the value logged at its own step."""
    import re

    import lightning.pytorch as pl

    from lit_trainer.callbacks.progress import LineProgressBar

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.log("seen_step", float(self.trainer.global_step), prog_bar=True, on_step=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=1)
    trainer = pl.Trainer(
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[LineProgressBar(every_n_steps=2)],
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), loader)
    lines = re.findall(r"step (\d+)/6 \| epoch 0 \| seen_step ([0-9.]+)", capsys.readouterr().out)
    assert [int(step) for step, _ in lines] == [2, 4, 6]
    assert all(float(value) == float(step) for step, value in lines), lines


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer:\n\tmax_steps: 3\n", r'"{path}", line 2, column 1: a tab character; YAML indents with spaces only'),
        ("trainer:\n  max_steps: 3\n  \tx: 1\n", r'"{path}", line 3, column 3: a tab character'),
        ("trainer:\n  max_steps: [3\n", r'"{path}", line 3, column 1: expected .* flow sequence that starts at line 2'),
        (
            "trainer:\n  max_steps: 3\n   x: 1\n",
            r"\"{path}\", line 3, column 5: mapping values are not allowed here",
        ),
    ],
)
def test_a_broken_config_file_is_named_with_its_line_and_tabs_are_called_tabs(tmp_path, capsys, text, expected):
    """jsonargparse said `in "<unicode string>", line 2` and never "tab"; the user needs the file and the line."""
    from lit_trainer.cli.app import main

    config = tmp_path / "recipe.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config)])
    err = capsys.readouterr().err
    assert re.search(expected.format(path=re.escape(str(config))), err), err
    assert "<unicode string>" not in err


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", r"it is empty \(0 bytes"),
        (b"PK\x03\x04 cut short", r"it is truncated or not a torch checkpoint \(14 bytes"),
    ],
)
def test_an_empty_or_truncated_checkpoint_is_named_in_the_words_of_the_command_line(tmp_path, capsys, content, reason):
    """The message once spoke of `resume=` and 'auto', options the command line does not have."""
    from lit_trainer.cli.app import main

    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(content)
    with pytest.raises(SystemExit):
        main(["fit", "--config", SFT, "--trainer.default_root_dir", str(tmp_path / "runs"), "--ckpt_path", str(ckpt)])
    err = capsys.readouterr().err
    assert re.search(rf"--ckpt_path {re.escape(str(ckpt))} cannot be resumed: {reason}", err), err
    assert "--ckpt_path last" in err and "resume=" not in err and "'auto'" not in err


def _reserve_at_once(args):
    root, pinned, barrier = args
    from lit_trainer.cli.runs import reserve_version

    barrier.wait()
    return reserve_version(root, pinned)[0]


@pytest.mark.parametrize("pinned", [None, 0], ids=["unpinned", "pinned"])
def test_runs_reserving_at_the_same_instant_get_different_folders_even_from_one_saved_config(tmp_path, pinned):
    """Every saved config.yaml pins its version: four launches of one saved config for a sweep must not share its
    folder (a folder another launch created a moment ago is empty, but taken)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # Linux: no re-import of torch in each process
    with context.Manager() as manager:
        barrier = manager.Barrier(4)
        with context.Pool(4) as pool:
            versions = pool.map(_reserve_at_once, [(tmp_path / "sft", pinned, barrier)] * 4)
    assert sorted(versions) == [0, 1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "sft").iterdir()) == [f"version_{n}" for n in range(4)]
