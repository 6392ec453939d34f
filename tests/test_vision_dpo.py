"""DPO on a vision-language model (``tiny-vl``): the pair collator with images, TRL 1.16 parity, a short fit, refusals.

TRL runs its own code: ``DataCollatorForVisionPreference`` on the same rows and ``DPOTrainer.compute_loss`` on the
same model, reference and batch. Known difference (documented): string rows get an EOS after each completion (as text
pairs do, in TRL and here); TRL's vision collator adds none, so string rows are compared with the EOS written in.
"""

from __future__ import annotations

import copy
import io
import os

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset, List
from datasets import Image as ImageFeature
from PIL import Image

from helpers.rounding import Rounding, relative_l2
from lit_trainer.data import builtin_shapes
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.vision.preference import VisionPreferenceCollator
from lit_trainer.data.vision.rows import ROW_KEY
from lit_trainer.models import build_processor, load_model
from lit_trainer.modules.dpo import DPOModule

trl = pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
IMAGE_ID, EOS, PAD = 384, 1, 0  # tiny-vl's <image>, </s> and <pad>
TOKENS_PER_IMAGE = 16
SHAPES = builtin_shapes.preference_rows("validation").select(range(6)).remove_columns("answer")


def png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def pil(value: bytes) -> Image.Image:
    return Image.open(io.BytesIO(value)).convert("RGB")


def b(text: str) -> list[int]:
    """ByT5 ids of ``text`` (byte + 3)."""
    return [c + 3 for c in text.encode()]


@pytest.fixture(scope="module")
def processor():
    return build_processor()


def ours(processor, rows: list[dict], max_length: int = 128) -> dict[str, torch.Tensor]:
    return VisionPreferenceCollator(processor, "images", max_length)([{**r, ROW_KEY: i} for i, r in enumerate(rows)])


def theirs(processor, rows: list[dict]) -> dict[str, torch.Tensor]:
    rows = [{**copy.deepcopy({k: v for k, v in r.items() if k != "images"}), "images": r["images"]} for r in rows]
    return trl.trainer.dpo_trainer.DataCollatorForVisionPreference(processor)(rows)


def unpadded(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TRL's ``input_ids`` with tiny-vl's pad id at the padded positions: TRL pads completions with
    ``pad_token_id or eos_token_id``, which is the EOS for a pad id of 0 (masked out either way)."""
    return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, PAD)


def test_collator_layout_on_hand_checked_rows(processor):
    red, blue, green = png((255, 0, 0)), png((0, 0, 255)), png((0, 255, 0))
    rows = [
        {"images": [red], "prompt": "<image>Q?", "chosen": "4", "rejected": "56"},
        {"images": [blue, green], "prompt": "A<image><image>", "chosen": "7</s>", "rejected": "8"},
    ]
    batch = ours(processor, rows)
    image = [IMAGE_ID] * TOKENS_PER_IMAGE
    expected = [  # chosen rows, then rejected rows; an EOS ends each string completion; right-padded
        (image + b("Q?"), b("4") + [EOS]),
        (b("A") + image + image, b("7") + [EOS]),
        (image + b("Q?"), b("56") + [EOS]),
        (b("A") + image + image, b("8") + [EOS]),
    ]
    width = max(len(p) + len(c) for p, c in expected)
    assert batch["input_ids"].shape == (4, width)
    for row, (prompt, completion) in enumerate(expected):
        ids, pad = prompt + completion, width - len(prompt) - len(completion)
        assert batch["input_ids"][row].tolist() == ids + [PAD] * pad
        assert batch["attention_mask"][row].tolist() == [1] * len(ids) + [0] * pad
        assert batch["completion_mask"][row].tolist() == [0] * len(prompt) + [1] * len(completion) + [0] * pad
    assert not batch["completion_mask"][batch["input_ids"] == IMAGE_ID].any()  # image tokens are never scored
    # every pair's images once for its chosen row and once for its rejected row, in row order
    pixels = batch["pixel_values"]
    assert pixels.shape == (6, 3, 32, 32)
    assert torch.equal(pixels[:3], pixels[3:])
    assert not torch.equal(pixels[0], pixels[1]) and not torch.equal(pixels[1], pixels[2])
    single = processor.image_processor([pil(blue)], return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels[1], single[0])


def test_collator_equals_trl(processor):
    structured = [{**SHAPES[i], "images": [pil(v) for v in SHAPES[i]["images"]]} for i in range(3)]
    images = [pil(png((255, 0, 0))), pil(png((0, 0, 255)))]
    plain_turns = [  # string contents: the images go to the start of the first USER turn (not the system turn)
        {
            "images": images,
            "prompt": [{"role": "system", "content": "Count."}, {"role": "user", "content": "How many red?"}],
            "chosen": [{"role": "assistant", "content": "1"}],
            "rejected": [{"role": "assistant", "content": "two"}],
        }
    ]
    strings = [  # string rows: TRL's vision collator adds no EOS, so it is written in here (ours adds it if absent)
        {"images": images[:1], "prompt": "<image>How many red?", "chosen": "1</s>", "rejected": "22</s>"},
        {"images": images, "prompt": "<image> and <image>?", "chosen": "no</s>", "rejected": "yes</s>"},
    ]
    for rows in (structured, plain_turns, strings):
        got, expected = ours(processor, rows), theirs(processor, rows)
        assert set(got) == {"input_ids", "attention_mask", "completion_mask", "pixel_values"}
        expected["input_ids"] = unpadded(expected)
        for key in got:
            assert torch.equal(got[key], expected[key]), key
        assert got["input_ids"][0].tolist().count(IMAGE_ID) == TOKENS_PER_IMAGE * len(rows[0]["images"])
    without_eos = [{**r, "chosen": r["chosen"][:-4], "rejected": r["rejected"][:-4]} for r in strings]
    assert torch.equal(ours(processor, without_eos)["input_ids"], ours(processor, strings)["input_ids"])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _trl_step(trainer, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.slow  # building TRL's trainer takes ~4 s
def test_dpo_loss_and_gradients_equal_trl(processor, tmp_path):
    torch.manual_seed(0)
    policy = load_model("tiny-vl")
    torch.manual_seed(1)
    reference = load_model("tiny-vl")  # another model, so the log-ratios (and the sigmoid's slope) are not trivial
    rows = SHAPES.select(range(4)).cast_column("images", List(ImageFeature()))
    losses = ["sigmoid", "sft"]
    args = trl.DPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_length=None, loss_type=losses,
        loss_weights=[1.0, 1.0], beta=0.1, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args, train_dataset=rows,
        processing_class=processor,
    )  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trl_loss, trl_grads = _trl_step(trainer, trainer.model, batch)
    # a real mistake: the pairs' images shuffled (the policy and the reference see another pair's picture)
    wrong = {**batch, "pixel_values": batch["pixel_values"].roll(1, 0)}
    wrong_loss, wrong_grads = _trl_step(trainer, trainer.model, wrong)
    # calibration: TRL's own computation in float64 (TRL patches its models' forward: convert them in place). Measured:
    # gradient scale 4.5e-7, ours (plain and chunked logits) 1.0e-7 from TRL's float32 gradient, bound 1.8e-6, the
    # shuffled-images mistake 1.1e-1. TRL's fused head returns float32 log-probs even from a float64 model, so the
    # loss scale is 0 and its bound is float32's floor (2.4e-7); ours is 7e-8 from TRL's loss, the mistake 7e-3.
    trainer.model.double(), trainer.ref_model.double()
    trl64_loss, trl64_grads = _trl_step(
        trainer, trainer.model, {**batch, "pixel_values": batch["pixel_values"].double()}
    )
    grad_rounding = Rounding.of(trl_grads, trl64_grads, what="gradient")
    loss_rounding = Rounding.of({"loss": trl_loss}, {"loss": trl64_loss}, what="loss")

    ours_batch = ours(processor, [rows[i] for i in range(len(rows))])
    assert torch.equal(ours_batch["input_ids"], unpadded(batch))
    for key in ("attention_mask", "completion_mask", "pixel_values"):
        assert torch.equal(ours_batch[key], batch[key]), key
    for chunked in ("off", "on"):
        module = DPOModule(
            copy.deepcopy(policy), ref_model=copy.deepcopy(reference), loss_type=losses, chunked_logits=chunked,
            train_vision_tower=True,  # as TRL, which trains every weight
        )  # fmt: skip
        module.train()
        loss, _ = module.compute_loss(ours_batch, None)
        loss.backward()
        grads = _grads(module.model)
        assert set(grads) == set(trl_grads) and any("vision_tower" in name for name in grads)
        loss_rounding.check({"loss": loss.detach()}, {"loss": trl_loss}, mistake=abs(float(wrong_loss - trl_loss)))
        grad_rounding.check(grads, trl_grads, mistake=relative_l2(wrong_grads, trl_grads))


@pytest.mark.slow  # ~3 s: three DPO steps and a validation pass of tiny-vl
def test_short_dpo_fit_on_builtin_shapes():
    assert PreferenceDataModule.builtin["builtin:shapes"] is builtin_shapes.preference_rows
    rows = builtin_shapes.preference_rows("train").select(range(12))
    dm = PreferenceDataModule(
        tokenizer="tiny-vl", dataset=rows, validation_dataset=rows.select(range(4)), batch_size=4, max_length=64
    )
    torch.manual_seed(0)
    module = DPOModule("tiny-vl", loss_type=["sigmoid", "sft"], learning_rate=1e-3, chunked_logits="on")
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    ref_before = {n: p.detach().clone() for n, p in module.ref_model.named_parameters()}
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=3, limit_val_batches=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["val_loss"]) and 0.0 <= float(metrics["val_rewards/accuracies"]) <= 1.0
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])}
    assert not any("vision_tower" in n for n in changed)  # frozen by default (train_vision_tower=False)
    assert any("multi_modal_projector" in n for n in changed) and any("language_model" in n for n in changed)
    assert all(torch.equal(p, ref_before[n]) for n, p in module.ref_model.named_parameters())


def _setup(rows: dict, **options) -> PreferenceDataModule:
    dm = PreferenceDataModule(
        tokenizer="tiny-vl", dataset=Dataset.from_dict(rows), val_size=0, max_length=64, **options
    )
    dm.setup("fit")
    return dm


def _turns(*parts) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}
    ]


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


RED = png((255, 0, 0))
GOOD = {"images": [[RED], [RED]], "prompt": [_turns(None, "a?"), _turns(None, "b?")]} | {
    "chosen": [_answer("1"), _answer("2")],
    "rejected": [_answer("3"), _answer("4")],
}


@pytest.mark.parametrize(
    ("rows", "options", "match"),
    [
        ({**GOOD, "prompt": [_turns(None, "a?"), _turns(None, None, "b?")]}, {}, r"row 1.*2 image placeholder"),
        ({**GOOD, "chosen": [_answer("1"), _turns(None)]}, {}, r"row 1.*column 'chosen'.*image part in a completion"),
        ({k: v for k, v in GOOD.items() if k != "prompt"}, {}, r"no 'prompt' column"),
        (GOOD, {"truncation_mode": "keep_end"}, r"keep_end.*not supported for rows with images"),
        (GOOD, {"packing": "padding_free"}, r"packing='padding_free'.*not supported for rows with images"),
    ],
)
def test_bad_image_pairs_are_refused_with_the_row(rows, options, match):
    with pytest.raises(ValueError, match=match):
        _setup(rows, **options)


def test_precompute_and_reference_free_modules_refuse_images():
    dm = _setup(GOOD)
    with pytest.raises(
        ValueError, match="precompute_ref_log_probs=True.*not supported for preference rows with images"
    ):
        dm.fingerprint("train")
    from lit_trainer.modules.orpo import ORPOModule

    batch = dm._collate([dm.train_dataset[0]], True)
    with pytest.raises(ValueError, match="ORPOModule does not take preference rows with images"):
        ORPOModule("tiny-vl").score(None, batch)


# ------------------------------------------------------------------------------- the modules that take no images yet
def test_kto_data_refuses_rows_with_images_instead_of_dropping_them():
    from lit_trainer.data.unpaired import UnpairedPreferenceDataModule

    rows = Dataset.from_dict({"prompt": ["a"], "completion": ["b"], "label": [True], "images": [[png((255, 0, 0))]]})
    with pytest.raises(ValueError, match=r"has images \(column 'images'\), which KTO does not take"):
        UnpairedPreferenceDataModule(tokenizer="tiny-vl", dataset=rows, val_size=0).setup("fit")


def test_reward_module_refuses_a_batch_with_images_instead_of_scoring_it_without_them():
    from lit_trainer import RewardModule

    ids = torch.tensor([[3, 4, 5], [3, 4, 6]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.zeros(2, 3, 32, 32)}
    module = RewardModule("tiny-64")
    module.rewards({k: v for k, v in batch.items() if k != "pixel_values"})  # the same batch without images scores
    with pytest.raises(ValueError, match="does not take preference rows with images"):
        module.rewards(batch)
