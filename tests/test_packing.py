"""Padding-free packing (SFT): bins, flattening, the unchanged loss and gradient, and the refusal of leaky models."""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.accumulation import TEXTS, accum_datamodule, fit_grads, full_batch, relative_error
from helpers.models import tiny_llama
from helpers.rounding import Rounding, relative_l2
from lit_trainer.callbacks import ExactResume
from lit_trainer.data.packing import best_fit_decreasing, flatten_sequences
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.modules.base._packing import packing_leak
from lit_trainer.modules.causal_lm import CausalLMModule


def _dm(tokenizer, packing, batch_size=2, **kw):
    return accum_datamodule(tokenizer, batch_size, packing=packing, **kw)


def test_best_fit_decreasing_hand_case_and_invariants():
    # 9, 8, 6, 5, 4, 3, 2 into bins of 10: 9 | 8+2 | 6+4 | 5+3 (best fit: 4 goes to the 6-bin, the tightest)
    lengths = [5, 9, 2, 6, 3, 8, 4]
    bins = best_fit_decreasing(lengths, 10)
    assert [sorted(lengths[i] for i in b) for b in bins] == [[9], [2, 8], [4, 6], [3, 5]]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="more than the bin capacity 10"):
        best_fit_decreasing([11], 10)


def test_flatten_masks_each_row_start_and_prompt():
    ids, positions, labels = flatten_sequences([[10, 11, 12], [20, 21, 22, 23], [30, 31]], [0, 2, 0])
    assert ids == [10, 11, 12, 20, 21, 22, 23, 30, 31]
    assert positions == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    assert labels == [-100, 11, 12, -100, -100, 22, 23, -100, 31]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_per_token_losses_equal_unpacked(tokenizer, attn):
    model = tiny_llama(seed=4, layers=2)
    model.config._attn_implementation = attn
    model.eval()
    rows = [{"input_ids": tokenizer(t)["input_ids"], "prompt_length": 0} for t in TEXTS[:4]]
    padded, packed = _dm(tokenizer, "none"), _dm(tokenizer, "padding_free")
    padded.tokenizer = packed.tokenizer = tokenizer
    a, b = padded._collate(rows, True), packed._collate(rows, True)
    assert "attention_mask" not in b and b["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows))
    with torch.no_grad():
        la = model(input_ids=a["input_ids"], attention_mask=a["attention_mask"]).logits
        lb = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    ce_a = F.cross_entropy(la[:, :-1].transpose(1, 2), a["labels"][:, 1:], reduction="none")
    ce_b = F.cross_entropy(lb[:, :-1].transpose(1, 2), b["labels"][:, 1:], reduction="none")
    kept_a = ce_a[a["labels"][:, 1:] != -100]  # row by row, in order: the same targets as the packed row's
    kept_b = ce_b[b["labels"][:, 1:] != -100]
    assert kept_a.shape == kept_b.shape
    # tolerance: the padded losses' float32 rounding against the same forward in float64 (helpers/rounding.py); a
    # real mistake: the packed rows attending to each other (the packed batch without its position ids)
    with torch.no_grad():
        la64 = copy.deepcopy(model).double()(input_ids=a["input_ids"], attention_mask=a["attention_mask"]).logits
        leaked = model(input_ids=b["input_ids"], use_cache=False).logits
    ce_a64 = F.cross_entropy(la64[:, :-1].transpose(1, 2), a["labels"][:, 1:], reduction="none")
    ce_leaked = F.cross_entropy(leaked[:, :-1].transpose(1, 2), b["labels"][:, 1:], reduction="none")
    mistake = relative_l2({"ce": ce_leaked[b["labels"][:, 1:] != -100]}, {"ce": kept_a})
    rounding = Rounding.of({"ce": kept_a}, {"ce": ce_a64[a["labels"][:, 1:] != -100]}, what="per-token losses")
    rounding.check({"ce": kept_b}, {"ce": kept_a}, mistake=mistake)
    assert int(packed.count_items(b)) == int(padded.count_items(a)) == kept_a.numel()


def test_padding_free_accumulation_equals_full_batch_gradient(tokenizer):
    model = tiny_llama(seed=1)
    reference_dm = accum_datamodule(tokenizer)
    reference_dm.setup("fit")
    reference = full_batch(model, reference_dm, list(range(8)))  # calibrated tolerance: helpers/rounding.py
    module = CausalLMModule(copy.deepcopy(model), tokenizer=tokenizer, max_grad_norm=None, learning_rate=0.0)
    grads = fit_grads(module, _dm(tokenizer, "padding_free"), accumulate=4, max_steps=1)
    assert len(grads) == 1
    reference.check(grads[0])


def test_bfd_bins_hold_every_row_and_give_the_full_batch_gradient(tokenizer):
    model = tiny_llama(seed=2)
    dm = _dm(tokenizer, "bfd", batch_size=2)  # two bins per micro-batch, each bin one row
    dm.setup("fit")
    bins = dm.train_dataset
    assert len(bins) < len(TEXTS)  # rows were really packed together
    assert all(n <= 64 for n in bins["length"]) and sum(bins["length"]) == sum(sum(b) for b in bins["seq_lengths"])
    assert sorted(n for b in bins["seq_lengths"] for n in b) == sorted(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert dm.lengths() == bins["length"]  # what group_by_length sorts: the bins' token counts
    reference_dm = accum_datamodule(tokenizer)
    reference_dm.setup("fit")
    reference = full_batch(model, reference_dm, list(range(8)))
    module = CausalLMModule(copy.deepcopy(model), tokenizer=tokenizer, max_grad_norm=None, learning_rate=0.0)
    grads = fit_grads(module, dm, accumulate=-(-len(bins) // 2), max_steps=1)
    reference.check(grads[0])


def test_bfd_micro_batch_is_one_row_per_bin_with_inert_end_padding(tokenizer):
    dm = _dm(tokenizer, "bfd", batch_size=2, max_tokens_per_batch=None)
    dm.tokenizer = tokenizer
    bins = [
        {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2], "prompt_lengths": [0, 1]},
        {"input_ids": [10, 11, 12], "seq_lengths": [3], "prompt_lengths": [0]},
    ]
    batch = dm._collate(bins, True)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 11, 12, -100, -100]]
    assert batch["packed_token_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    module = CausalLMModule(tiny_llama(), tokenizer=tokenizer)
    module._reset_log_window()
    module._step_loss = 0.0
    module._track(torch.tensor(0.0), {}, batch)
    assert (int(module._log_real), module._log_padded) == (8, 10)


def test_packed_fit_trains_like_the_padded_fit(tokenizer):
    """Three optimizer steps with a real learning rate land on the same weights, packed or padded."""
    model = tiny_llama(seed=5)
    weights = []
    # the padded fit in float32, the packed one, and the padded one in float64: the rounding scale of the padded
    # fit (helpers/rounding.py), which Adam's 1/sqrt(v) amplifies over the steps by a machine-dependent amount
    for packing, dtype in (("none", torch.float32), ("padding_free", torch.float32), ("none", torch.float64)):
        module = CausalLMModule(
            copy.deepcopy(model).to(dtype), tokenizer=tokenizer, max_grad_norm=None, learning_rate=1e-2, warmup_steps=0
        )
        fit_grads(module, _dm(tokenizer, packing), accumulate=2, max_steps=3)
        weights.append({n: p.detach().clone() for n, p in module.model.named_parameters()})
    moved = relative_error({n: p.detach() for n, p in model.named_parameters()}, weights[0])
    assert moved > 1e-3  # training changed the weights, so the comparison below means something
    rounding = Rounding.of(weights[0], weights[2], what="packed-fit weights")
    rounding.check(weights[1], weights[0], mistake=moved / 3)  # a real mistake: one step's change, on average


def test_packed_batches_log_no_padding(tokenizer):
    module = CausalLMModule(tiny_llama(), tokenizer=tokenizer)
    module._reset_log_window()
    module._step_loss = 0.0
    batch = _dm(tokenizer, "padding_free")._collate(
        [{"input_ids": [5, 6, 7], "prompt_length": 0}, {"input_ids": [8, 9], "prompt_length": 0}], True
    )
    module._track(torch.tensor(0.0), {}, batch)
    assert (int(module._log_real), module._log_padded, module._step_cost) == (5, 5, 5)


def _causal_only_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention kernel that ignores the mask (only ``is_causal``): it cannot keep packed rows apart."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def leaky_model() -> torch.nn.Module:
    """``tiny_llama(seed=6)`` with :func:`_causal_only_attention` registered as ``causal_only_test``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("causal_only_test", _causal_only_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("causal_only_test", sdpa_mask)
    model = tiny_llama(seed=6)
    model.config._attn_implementation = "causal_only_test"
    return model


def test_refuses_an_attention_that_cannot_keep_rows_apart(tokenizer):
    leaky = leaky_model()
    assert packing_leak(leaky) > 1e-2
    assert packing_leak(tiny_llama(seed=6)) < 1e-5  # the same weights with sdpa keep rows apart
    module = CausalLMModule(leaky, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"packing='padding_free'.*causal_only_test.*packing='none'"):
        fit_grads(module, _dm(tokenizer, "padding_free"), accumulate=1, max_steps=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"packing": "dense"}, "packing='dense'"),
        ({"packing": "padding_free", "max_tokens_per_batch": 256}, "set packing='bfd'"),
        ({"packing": "bfd", "max_tokens_per_batch": 32}, "below `max_length=64`"),
        ({"packing": "bfd", "max_tokens_per_batch": 256, "batch_size": 4}, "set `batch_size=1`"),
    ],
)
def test_bad_packing_options_are_refused(tokenizer, kwargs, match):
    options = {"tokenizer": tokenizer, "max_length": 64, "batch_size": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        SFTDataModule(**options)


@pytest.mark.parametrize("packing", ["padding_free", "bfd"])
def test_packed_run_resumes_exactly(tokenizer, tmp_path, packing):
    base = tiny_llama(seed=7)

    def run(ckpt=None, save=False):
        dm = SFTDataModule(
            tokenizer=tokenizer,
            dataset=Dataset.from_dict({"text": TEXTS * 3}),
            val_size=0,
            batch_size=2,
            max_length=64,
            sampling="random",
            packing=packing,
        )
        module = CausalLMModule(copy.deepcopy(base), tokenizer=tokenizer, learning_rate=1e-2, scheduler="constant")
        saves = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)] if save else []
        trainer = pl.Trainer(
            max_steps=4,
            accumulate_grad_batches=2,
            logger=False,
            callbacks=[ExactResume(), *saves],
            enable_checkpointing=save,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
        return {n: p.detach() for n, p in module.model.named_parameters()}

    full = run(save=True)
    resumed = run(ckpt=tmp_path / "epoch=0-step=2.ckpt")
    assert all(torch.equal(resumed[n], full[n]) for n in full)


@pytest.mark.ddp
def test_ddp_padding_free_accumulation_equals_full_batch_gradient(ddp_world, tokenizer):
    out = ddp_world.part("grad_accum_padding_free")  # tests/scripts/ddp_grad_accum.py - padding_free
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(batch.size(0) == 1 for r in ranks for batch in r["seen"])  # really packed
    dm = accum_datamodule(tokenizer)
    dm.setup("fit")
    reference = full_batch(tiny_llama(seed=1), dm, list(range(8)))
    for r in ranks:
        reference.check(r["grads"][0])


def _report(monkeypatch, tokenizer, dataset, **kw) -> tuple[str, SFTDataModule]:
    """The data module's one-line data report, and the data module."""
    from lit_trainer.data import base

    messages: list[str] = []
    monkeypatch.setattr(base, "rank_zero_info", messages.append)
    dm = SFTDataModule(tokenizer=tokenizer, dataset=dataset, **kw)
    dm.setup("fit")
    assert len(messages) == 1 and messages[0].startswith("[lit_trainer] data: ")
    return messages[0], dm


@pytest.mark.parametrize("packing", ["none", "bfd"])
def test_data_report_counts_training_rows_not_bins(tokenizer, monkeypatch, packing):
    # builtin:addition has 8100 rows, 500 of them held out for validation: 7600 training rows, packed or not
    report, dm = _report(monkeypatch, tokenizer, "builtin:addition", max_length=32, packing=packing)
    if packing == "none":
        assert "data: 7600 training rows, 500 validation rows" in report
    else:
        bins = len(dm.train_dataset)
        assert bins < 7600 and sum(len(b) for b in dm.train_dataset["seq_lengths"]) == 7600
        assert f"data: 7600 training rows packed into {bins} sequences, 500 validation rows" in report
        assert "packed bins" not in report and "rows packed (" not in report


def test_data_report_counts_the_rows_kept_after_drops_with_bfd(tokenizer, monkeypatch):
    # 40 rows, 3 of them with no completion token within max_length (dropped): 37 rows go into the bins
    rows = {"prompt": ["1+1="] * 37 + ["x" * 20] * 3, "completion": ["2"] * 40}
    with pytest.warns(UserWarning, match="3 rows had no completion token left"):
        report, dm = _report(monkeypatch, tokenizer, Dataset.from_dict(rows), max_length=16, val_size=0, packing="bfd")
    assert sum(len(b) for b in dm.train_dataset["seq_lengths"]) == 37
    assert f"data: 37 training rows packed into {len(dm.train_dataset)} sequences," in report
    assert "3 train rows dropped without target" in report
