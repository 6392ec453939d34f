"""Precomputed reference log-probs reach every batch, whenever Lightning builds the loaders (DPO and KTO).

The precompute pass runs at ``on_fit_start`` (``on_validation_start`` for a ``validate``), but Lightning may build a
loader before it: ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``, which builds the training
loader when ``max_epochs`` is set (also on a resume), and the evaluation loop starts iterating its loader before
``on_validation_start``. Every training and validation batch of a precompute run must carry the columns, and the losses
must equal those of the same run with the live reference (the same reference model, so the same numbers up to float32
rounding: the precompute pass pads its batches differently; the tolerance is the one of
``tests/test_dpo_module.py::test_precompute_matches_live_reference_with_less_memory_and_a_keyed_cache``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from helpers.models import tiny_llama
from lit_trainer.data import builtin
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.unpaired import REF_KEY, REF_KL_KEY, UnpairedPreferenceDataModule, addition_unpaired_rows
from lit_trainer.modules.dpo import DPOModule
from lit_trainer.modules.kto import KTOModule

# 8 training rows in micro-batches of 4: 2 optimizer steps per epoch; 4 validation rows
OPTIONS = {"batch_size": 4, "eval_batch_size": 4, "max_length": 32}


@dataclass(frozen=True)
class Recipe:
    name: str
    module: Callable[..., DPOModule]
    data: Callable[[Any], pl.LightningDataModule]
    columns: tuple[str, str]


def _dpo_data(tokenizer) -> PreferenceDataModule:
    train, validation = builtin.preference_rows("train"), builtin.preference_rows("validation")
    return PreferenceDataModule(
        tokenizer=tokenizer, dataset=train.select(range(8)), validation_dataset=validation.select(range(4)), **OPTIONS
    )


def _kto_data(tokenizer) -> UnpairedPreferenceDataModule:
    train, validation = addition_unpaired_rows("train"), addition_unpaired_rows("validation")
    return UnpairedPreferenceDataModule(
        tokenizer=tokenizer, dataset=train.select(range(8)), validation_dataset=validation.select(range(4)), **OPTIONS
    )


RECIPES = [
    Recipe("dpo", DPOModule, _dpo_data, ("ref_chosen_logps", "ref_rejected_logps")),
    Recipe("kto", KTOModule, _kto_data, (REF_KEY, REF_KL_KEY)),
]


def _module(recipe: Recipe, precompute: bool) -> DPOModule:
    # a reference other than the policy: the loss depends on the reference's values from the first step on
    return recipe.module(
        tiny_llama(0),
        ref_model=tiny_llama(1),
        beta=0.5,
        learning_rate=1e-3,
        scheduler="constant",
        precompute_ref_log_probs=precompute,
    )


class Batches(Callback):
    """Training losses, and whether each training / validation batch (sanity check included) carried the columns."""

    def __init__(self, columns: tuple[str, str]) -> None:
        self.columns, self.losses, self.train, self.val = columns, [], [], []

    def _has(self, batch: dict[str, Any]) -> bool:
        return all(column in batch for column in self.columns)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.train.append(self._has(batch))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.val.append(self._has(batch))


def _trainer(callbacks: list[Callback], **kw: Any) -> pl.Trainer:
    kw = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
        **kw,
    }
    return pl.Trainer(callbacks=callbacks, **kw)


def _fit(
    recipe: Recipe, tokenizer, precompute: bool, extra: tuple[Callback, ...] = (), **kw: Any
) -> tuple[Batches, pl.Trainer, DPOModule]:
    pl.seed_everything(0)
    batches, module = Batches(recipe.columns), _module(recipe, precompute)
    trainer = _trainer([batches, *extra], **kw)
    trainer.fit(module, datamodule=recipe.data(tokenizer))
    return batches, trainer, module


def _check_equal_losses(pre: Batches, live: Batches) -> None:
    assert pre.losses and len(pre.losses) == len(live.losses)
    # the first step: the same weights, so only the reference values can differ
    torch.testing.assert_close(torch.tensor(pre.losses[0]), torch.tensor(live.losses[0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(pre.losses), torch.tensor(live.losses), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize(
    "stop",
    [
        {"max_epochs": 1},  # estimated_stepping_batches builds the training loader in configure_optimizers
        {"max_steps": 2},  # max_epochs unset: the loader is built by the fit loop, after on_fit_start
        {"max_steps": 2, "max_epochs": 1},  # the defect's command line
        {"max_epochs": 2, "reload_dataloaders_every_n_epochs": 1},  # a second training loader at epoch 2
    ],
    ids=["max_epochs", "max_steps", "both", "reload"],
)
def test_every_batch_carries_the_precomputed_columns_and_the_loss_is_the_live_one(recipe, stop, tokenizer):
    live, live_trainer, live_module = _fit(recipe, tokenizer, False, **stop)
    pre, pre_trainer, pre_module = _fit(recipe, tokenizer, True, **stop)
    assert pre_module.ref_model is None and live_module.ref_model is not None  # released: no live fallback
    assert not any(live.train) and not any(live.val)
    assert all(pre.train) and all(pre.val) and pre.val  # the sanity check and the epoch-end validation included
    assert pre_trainer.global_step == live_trainer.global_step == (4 if stop.get("max_epochs") == 2 else 2)
    _check_equal_losses(pre, live)
    torch.testing.assert_close(
        pre_trainer.callback_metrics["val_loss"], live_trainer.callback_metrics["val_loss"], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_validate_before_fit_reads_the_precomputed_columns(recipe, tokenizer):
    """``validate`` builds and starts its loader before ``on_validation_start`` runs the pass (without releasing the
    reference); a later ``fit`` with ``max_epochs`` reuses the values and trains on them."""
    results = {}
    for precompute in (False, True):
        batches, module, data = Batches(recipe.columns), _module(recipe, precompute), recipe.data(tokenizer)
        # inference_mode=False: a module validated under inference mode cannot be fitted afterwards (its validation
        # metric states become inference tensors), a separate defect that is not this test's subject
        validator = _trainer([batches], inference_mode=False)
        results[precompute] = validator.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
        assert all(batches.val) == precompute and batches.val
    assert module.ref_model is not None  # validate keeps the reference for a later fit
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-6)
    fitted = Batches(recipe.columns)
    _trainer([fitted], max_epochs=1).fit(module, datamodule=data)
    assert all(fitted.train) and all(fitted.val) and module.ref_model is None


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_resume_with_max_epochs_reads_the_checkpointed_columns(recipe, tokenizer, tmp_path):
    """A resumed fit builds its training loader before ``on_fit_start`` too (``max_epochs`` set); the values come
    from the checkpoint (the reference is gone) and the resumed epoch trains as the uninterrupted run's."""
    straight, _, _ = _fit(recipe, tokenizer, True, max_epochs=2, num_sanity_val_steps=0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    _fit(recipe, tokenizer, True, (checkpoints,), max_epochs=1, num_sanity_val_steps=0, enable_checkpointing=True)
    (saved,) = tmp_path.glob("*.ckpt")
    resumed = Batches(recipe.columns)
    module = _module(recipe, True)
    _trainer([resumed], max_epochs=2, num_sanity_val_steps=0).fit(
        module, datamodule=recipe.data(tokenizer), ckpt_path=saved
    )
    assert all(resumed.train) and all(resumed.val) and len(resumed.losses) == 2
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses[2:]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the loaders alone
def test_loaders_read_their_source_when_an_iteration_starts():
    """A loader built from a function reads the dataset the function returns when an iteration starts (a column
    added after the loader was built reaches its batches); a dataset of another length is refused."""
    from torch.utils.data import default_collate

    from lit_trainer.data.loader import EvalLoader, TrainLoader
    from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler

    current = {"rows": [{"x": torch.tensor(i)} for i in range(4)]}
    train = TrainLoader(lambda: current["rows"], ShardedBatchSampler(4, 2, seed=0), default_collate)
    evaluate = EvalLoader(lambda: current["rows"], 2, default_collate)
    started = iter(evaluate)  # Lightning's evaluation loop starts the iterator before on_validation_start
    current["rows"] = [dict(row, ref=row["x"] * 10) for row in current["rows"]]
    for batches in (list(train), list(started), list(evaluate)):
        assert len(batches) == 2 and all(torch.equal(b["ref"], b["x"] * 10) for b in batches)
    current["rows"] = current["rows"][:3]
    with pytest.raises(ValueError, match="changed from 4 to 3 rows after the loader was built"):
        list(train)
