"""An input check failing inside ``fit`` reaches the user as one message, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_trainer.cli import main
from lit_trainer.cli.errors import raised_by_our_checks

SFT = str(Path(__file__).resolve().parents[1] / "configs" / "sft.yaml")


def _fit_on_an_empty_file(tmp_path: Path) -> None:
    """``lit-trainer fit`` with the SFT config on an empty ``empty.jsonl`` (in ``tmp_path``, the working directory)."""
    (tmp_path / "empty.jsonl").write_text("")
    main(
        [
            "fit",
            "--config",
            SFT,
            "--data.init_args.dataset",
            "empty.jsonl",
            "--trainer.max_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )


def test_an_empty_data_file_is_one_message_and_exit_status_1(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIT_TRAINER_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exited:
        _fit_on_an_empty_file(tmp_path)
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "lit-trainer: error: empty.jsonl is empty: it has no rows" in err
    assert "Traceback" not in err and "LIT_TRAINER_TRACEBACK=1" in err


def test_the_traceback_comes_back_on_request(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIT_TRAINER_TRACEBACK", "1")
    with pytest.raises(ValueError, match="is empty"):
        _fit_on_an_empty_file(tmp_path)


def _raise(error: Exception) -> Exception:
    try:
        raise error
    except Exception as caught:
        return caught


def test_only_our_own_checks_lose_their_traceback():
    from lit_trainer.data.files import read_file  # raises for a missing file, from lit_trainer's own frame

    ours = None
    try:
        read_file(Path("/nonexistent/rows.jsonl"), "json")
    except Exception as error:
        ours = error
    assert ours is not None and raised_by_our_checks(ours)
    assert not raised_by_our_checks(_raise(ValueError("raised in a test file, not in lit_trainer")))
    assert not raised_by_our_checks(_raise(TypeError("a bug, not a check")))


def test_invalid_utf8_in_a_data_file_is_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIT_TRAINER_TRACEBACK", raising=False)
    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "1+1=2"}\n{"text": "2+2=\xff4"}\n')
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", SFT, "--data.init_args.dataset", "rows.jsonl", "--trainer.max_steps", "1"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "lit-trainer: error: line 2 of rows.jsonl: not valid UTF-8 (byte 0xff at character 15)" in err
    assert "Traceback" not in err and "UnicodeDecodeError" not in err
