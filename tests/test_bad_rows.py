"""A training row that cannot be loaded during training (issue 47, item 3): a picture that does not decode, deep in a
JSON-lines file of rows with images (``tiny-vl`` SFT).

* By default the run stops with one line naming the file and line of the row (not its position after the validation
  split) and the error, after ``JITCheckpoint`` saved the last finished optimizer step; once the picture is fixed,
  ``ckpt_path="last"`` continues the run to the same weights as a run that never met the bad picture.
* With ``skip_bad_rows=True`` the run finishes, the row is named in a warning and counted in ``data/skipped_rows``.
* A row refused at setup is named by its line as well. (Text rows cannot fail during training: they are tokenized at
  setup, whose errors name the file and line, ``tests/test_bad_data_files.py``.)
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from ddp_vision import vision_model  # tests/scripts
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_trainer.callbacks import ExactResume, JITCheckpoint, JITCheckpointFailure
from lit_trainer.data import SFTDataModule
from lit_trainer.data.bad_rows import BadRowError
from lit_trainer.data.builtin_shapes import draw
from lit_trainer.modules.causal_lm import CausalLMModule

ROWS, VAL, SEED, STEPS = 12, 2, 1234, 5  # 10 training rows in batches of 2: 5 optimizer steps, every row once
BAD_LINE = 9  # 1-based line of data.jsonl whose picture is a truncated PNG


def _write(folder: Path, bad: bool, long_text_line: int | None = None) -> Path:
    """``data.jsonl``: ``ROWS`` chat rows, one picture file each; line ``BAD_LINE``'s file is a truncated PNG (the
    first 40 bytes of a real one: setup checks that the file exists, only its batch decodes it) unless not ``bad``.
    Line ``long_text_line`` puts 100 words before its picture."""
    lines = []
    for i in range(ROWS):
        image = folder / f"{i}.png"
        png = draw([(i % 16, "red"), ((i * 5) % 16, "blue")])
        image.write_bytes(png[:40] if bad and i == BAD_LINE - 1 else png)
        before = [{"type": "text", "text": "word " * 100}] if i == (long_text_line or 0) - 1 else []
        messages = [
            {"role": "user", "content": [*before, {"type": "image"}, {"type": "text", "text": "How many red?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": str(i % 5)}]},
        ]
        lines.append(json.dumps({"images": [str(image)], "messages": messages}))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _fit(root: Path, data: Path, ckpt_path: str | None = None, **options: Any) -> tuple[CausalLMModule, pl.Trainer]:
    module = CausalLMModule(vision_model(), learning_rate=1e-2, scheduler="constant")
    dm = SFTDataModule(
        tokenizer="tiny-vl", dataset=str(data), batch_size=2, val_size=VAL, seed=SEED, sampling="sequential",
        max_length=96, **options,
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=STEPS, logger=CSVLogger(root, name="logs", version=0), log_every_n_steps=1, limit_val_batches=0,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[ExactResume(), JITCheckpoint(), ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=100)],
    )  # fmt: skip
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module, trainer


def _position_in_training() -> int:
    """Where line ``BAD_LINE``'s row lands in the training split (``datasets``' seeded split, as the data module
    splits): not at its own index, so a message naming the position would name another line."""
    parts = Dataset.from_dict({"i": list(range(ROWS))}).train_test_split(test_size=VAL, seed=SEED, shuffle=True)
    order = list(parts["train"]["i"])
    assert BAD_LINE - 1 in order and order.index(BAD_LINE - 1) != BAD_LINE - 1
    return order.index(BAD_LINE - 1)


def test_a_bad_picture_saves_the_last_step_names_its_line_and_the_run_continues(tmp_path: Path) -> None:
    position = _position_in_training()
    data = _write(tmp_path, bad=True)
    with pytest.raises(JITCheckpointFailure) as stop:
        _fit(tmp_path / "run", data)
    reason = stop.value.reason
    assert "\n" not in reason and stop.value.code == reason  # one line, printed by Python as the exit message
    assert reason.startswith(f"line {BAD_LINE} of {data}: ") and "does not decode as an image" in reason, reason
    # the batch holding the row is the step's first (and only) batch: the steps before it finished and were saved
    saved = Path(stop.value.checkpoint_path)
    assert saved.parent == tmp_path / "run" / "ck" and saved.name.startswith("last")
    assert torch.load(saved, weights_only=False)["global_step"] == position // 2 >= 1

    _write(tmp_path, bad=False)  # the picture fixed: the run continues from the checkpoint to its end
    resumed, trainer = _fit(tmp_path / "run", data, ckpt_path="last")
    assert trainer.global_step == STEPS
    whole, _ = _fit(tmp_path / "whole", data)  # never met the bad picture
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_skip_bad_rows_finishes_the_run_names_and_counts_the_row(tmp_path: Path) -> None:
    data = _write(tmp_path, bad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer = _fit(tmp_path, data, skip_bad_rows=True)
    assert trainer.global_step == STEPS
    named = [str(w.message) for w in caught if "skip_bad_rows=True: skipped" in str(w.message)]
    assert len(named) == 1 and f"line {BAD_LINE} of {data}: " in named[0], named
    rows = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("data/skipped_rows")
    counts = [float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]]
    assert counts[0] == 0 and counts[-1] == 1, counts  # counted when its batch came, once


def test_without_jit_checkpoint_the_error_names_the_line(tmp_path: Path) -> None:
    """No ``JITCheckpoint`` among the callbacks: nothing is saved, the error still names the row's line."""
    data = _write(tmp_path, bad=True)
    module = CausalLMModule(vision_model())
    dm = SFTDataModule(tokenizer="tiny-vl", dataset=str(data), batch_size=2, val_size=VAL, seed=SEED, max_length=96)
    trainer = pl.Trainer(
        max_steps=STEPS, logger=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(BadRowError, match=rf"^line {BAD_LINE} of {data}: .*does not decode as an image"):
        trainer.fit(module, datamodule=dm)


def test_a_row_refused_at_setup_is_named_by_its_line_not_its_place_after_the_split(tmp_path: Path) -> None:
    """A row refused while the rows are measured at setup (after the validation split: its image would be cut by
    ``max_length``) is named by its line too."""
    _position_in_training()  # the row is in the training split, at another position than its line's
    data = _write(tmp_path, bad=False, long_text_line=BAD_LINE)
    dm = SFTDataModule(tokenizer="tiny-vl", dataset=str(data), batch_size=2, val_size=VAL, seed=SEED, max_length=96)
    with pytest.raises(ValueError, match=rf"^line {BAD_LINE} of {data}: .*more than max_length=96.*cut an image"):
        dm.setup("fit")
