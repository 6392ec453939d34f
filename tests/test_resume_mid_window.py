"""A checkpoint written inside an accumulation window (a validation between two micro-batches of one optimizer step)
resumes exactly: the window's gradients so far are in the checkpoint and the loader counts the whole window again."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.accumulation import TEXTS
from helpers.models import tiny_llama
from lit_trainer.callbacks import ExactResume
from lit_trainer.callbacks.resume._window_grads import mid_window_validation_error
from lit_trainer.data.loader import NUM_ITEMS_KEY
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.modules.causal_lm import CausalLMModule


class _Seen(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []  # (global step, batch index, window item count)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.rows.append((trainer.global_step, batch_idx, int(batch[NUM_ITEMS_KEY])))


def _run(tokenizer: Any, root: Path, base: torch.nn.Module, extra: tuple = (), ckpt: Path | None = None):
    dm = SFTDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict({"text": TEXTS * 2}),
        validation_dataset=Dataset.from_dict({"text": TEXTS[:2]}),
        batch_size=2,
        max_length=64,
        sampling="random",
    )
    module = CausalLMModule(copy.deepcopy(base), tokenizer=tokenizer, learning_rate=1e-2, scheduler="constant")
    seen = _Seen()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        val_check_interval=3,
        logger=False,
        callbacks=[ExactResume(), seen, *extra],
        enable_checkpointing=bool(extra),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    return module, seen.rows


def test_checkpoint_inside_an_accumulation_window_resumes_bit_exactly(tokenizer: Any, tmp_path: Path) -> None:
    base = tiny_llama(seed=1, dropout=0.2)
    saves = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_loss", save_top_k=-1)  # at each validation's end
    full, full_rows = _run(tokenizer, tmp_path, base, extra=(saves,))
    path = tmp_path / "ck" / "epoch=0-step=1.ckpt"
    state = torch.load(path, weights_only=True)
    # the validation after micro-batch 3 falls in step 1's window (micro-batches 2 and 3): only micro-batch 2 ran
    assert state["global_step"] == 1
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 3}]
    window_grads = state["callbacks"]["ExactResume"]["window_grads"]
    assert set(window_grads[0]) == {f"model.{n}" for n, _ in base.named_parameters()}
    resumed, rows = _run(tokenizer, tmp_path, base, ckpt=path)
    # micro-batch 3 carries the token count of its whole window, as in the uninterrupted run
    assert rows == full_rows[3:] and rows[0][:2] == (1, 3)
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_sharded_strategy_with_validation_inside_windows_is_refused() -> None:
    message = mid_window_validation_error("FSDPStrategy", False, 2, 3, True)
    assert message is not None and "under FSDPStrategy" in message
    assert "`val_check_interval` to a multiple of `accumulate_grad_batches` (2)" in message
    assert mid_window_validation_error("FSDPStrategy", False, 2, 4, True) is None  # validations at step boundaries
    assert mid_window_validation_error("DDPStrategy", True, 2, 3, True) is None  # gradients saved per rank
    assert mid_window_validation_error("FSDPStrategy", False, 2, 3, False) is None  # no validation checkpoints
