"""Padding-free DPO batches: the same per-sequence log-probs, loss, metrics, counts and step gradient as padded ones."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from test_dpo_module import all_pairs, independent_gradient

from helpers.accumulation import GradCapture, calibrated
from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.modules.dpo import DPOModule

# uneven prompts and completions (so padding differs a lot between rows)
UNEVEN = {
    "prompt": ["1+2=", "100+200=", "5=", "a much longer prompt=", "7+8=", "x=", "12+12=", "what is 3+4="],
    "chosen": ["3", "300", "5", "ok", "15", "a longer chosen answer", "24", "7"],
    "rejected": ["4", "301", "six", "not ok at all", "16", "b", "42", "seven"],
}
LOSSES = ["sigmoid", "sft", "ipo"]


def _dm(tokenizer, packing: str, batch_size: int = 8, **kw) -> PreferenceDataModule:
    return PreferenceDataModule(
        tokenizer=tokenizer,
        dataset=Dataset.from_dict(UNEVEN),
        val_size=0,
        max_length=48,
        batch_size=batch_size,
        sampling="sequential",
        packing=packing,
        **kw,
    )


@pytest.mark.parametrize("ld_alpha", [None, 0.5])
def test_padding_free_loss_and_metrics_equal_padded(tokenizer, ld_alpha):
    module = DPOModule(tiny_llama(0), ref_model=tiny_llama(1), loss_type=LOSSES, beta=0.1, ld_alpha=ld_alpha)
    padded_dm, packed_dm = _dm(tokenizer, "none"), _dm(tokenizer, "padding_free")
    padded_dm.setup("fit")
    packed_dm.setup("fit")
    rows = [padded_dm.train_dataset[i] for i in range(8)]
    padded, packed = padded_dm._collate(rows, True), packed_dm._collate(rows, True)
    assert "attention_mask" not in packed and packed["input_ids"].size(0) == 1
    assert int(padded["attention_mask"].sum()) == packed["input_ids"].numel() < padded["input_ids"].numel()
    counts = padded_dm.count_items(padded)
    torch.testing.assert_close(packed_dm.count_items(packed), counts, rtol=0, atol=0)
    # a boundary error: each row's last completion token left out (what a packed row cut one token short gives)
    mask = padded["completion_mask"]
    off_by_one = {**padded, "completion_mask": mask * (mask.cumsum(-1) < mask.sum(-1, keepdim=True))}

    def outputs(module, batch) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            loss, metrics = module.compute_loss(batch, counts)
            return {"seq": module.score(module.model, batch).seq, "loss": loss, **metrics}

    module.eval()
    a, b, off = outputs(module, padded), outputs(module, packed), outputs(module, off_by_one)
    # tolerances: the padded values' float32 rounding against the same module in float64 (helpers/rounding.py)
    twin = outputs(module.double(), padded)
    assert float(a["seq"].std()) > 1.0  # the rows' sums really differ: a boundary error would show
    for name in a:
        if name == "rewards/accuracies":  # a fraction of pairs: rounding cannot move it, a boundary error need not
            assert torch.equal(b[name], a[name])
            continue
        rounding = Rounding.of({name: a[name]}, {name: twin[name]}, what=name)
        rounding.check({name: b[name]}, {name: a[name]}, mistake=relative_l2({name: off[name]}, {name: a[name]}))


def _one_step_trainer(**kw) -> pl.Trainer:
    return pl.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        **kw,
    )


def _step_gradient(tokenizer, packing: str, batch_size: int, accumulate: int) -> dict[str, torch.Tensor]:
    module = DPOModule(tiny_llama(0), loss_type=LOSSES, beta=0.1, learning_rate=1e-3)
    capture = GradCapture()
    trainer = _one_step_trainer(callbacks=[capture], accumulate_grad_batches=accumulate)
    trainer.fit(module, datamodule=_dm(tokenizer, packing, batch_size=batch_size))
    return capture.grads[0]


def test_padding_free_accumulation_equals_padded_full_batch(tokenizer):
    # micro-batches of 3, 3 and 2 pairs, packed, against one padded batch of the 8 pairs
    packed = _step_gradient(tokenizer, "padding_free", batch_size=3, accumulate=3)
    full = _step_gradient(tokenizer, "none", batch_size=8, accumulate=1)
    # tolerance: the independent gradient of the same step (tests/test_dpo_module.py), float32 against its float64
    # twin (helpers/rounding.py); a real mistake: the last pair lost
    dm = _dm(tokenizer, "none")
    dm.setup("fit")
    batch = all_pairs(dm)
    reference = calibrated(independent_gradient(batch, 8), tiny_llama(0), mistake=independent_gradient(batch, 7))
    reference.rounding.check(packed, full, mistake=reference.mistake)
    reference.check(packed)


def test_bfd_is_refused_for_pairs(tokenizer):
    with pytest.raises(ValueError, match="packing='padding_free'"):
        _dm(tokenizer, "bfd")


def test_dpo_refuses_packing_on_a_leaky_attention(tokenizer):
    from test_packing import leaky_model

    module = DPOModule(leaky_model(), loss_type=LOSSES, beta=0.1)
    trainer = _one_step_trainer()
    with pytest.raises(ValueError, match=r"packing='padding_free'.*causal_only_test"):
        trainer.fit(module, datamodule=_dm(tokenizer, "padding_free"))
