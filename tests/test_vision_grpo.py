"""GRPO on a vision-language model (``tiny-vl``): prompts with images, collated by hand-checkable rules, completions
generated and scored with the prompts' images, and the loss and gradients against TRL 1.16's ``GRPOTrainer``.

The TRL comparison: TRL tokenizes and generates one generation batch itself (``_generate_and_score_completions`` on
the same rows, its images as PIL images); our data module must give the same prompt ids and pixel values, and our
``compute_loss`` on TRL's completions and advantages the same loss and gradients as TRL's ``compute_loss``.

TRL runs at ``bf16=False``: at its default (``bf16=True``) it scores under bf16 autocast, also on the CPU, which puts
its gradient about 7e-3 (relative L2) from the float64 one, and a bound at that scale (it was 2.8e-2) would pass a GRPO
error of a few percent. In float32 TRL's gradient lies about 4.8e-7 from the same computation with the model in float64
(measured here, every run: :class:`helpers.rounding.Rounding`), and ours 2.0e-7 from TRL's float32 one. The bound is 4
times that scale (about 1.9e-6): the scale is measured on the machine running the test, with its kernels, and two
float32 evaluations in other orders each land about that far from the exact result, so they stay within 2 x the scale
of each other on any CPU. The loss measured equal bit for bit, and its own float32-vs-float64 distance 0 (one number
can round exactly), so it is held to the gradient's scale, the rounding of the same log-probs over many values. The
image-specific mistake, log-probs computed with another prompt's image, moves the gradient by about 0.45, over 10^5
bounds (the images are noise pictures, so the two prompts' image features differ clearly).
"""

from __future__ import annotations

import copy
import io
import logging
import os
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image

from helpers.rounding import Rounding, relative_l2, values
from lit_trainer.data import builtin_shapes
from lit_trainer.data.prompt import PromptDataModule, RolloutGeometry
from lit_trainer.data.vision.images import load_image
from lit_trainer.data.vision.prompt import ROW_IMAGES, model_image_inputs, pack_row_images
from lit_trainer.models import build_processor, build_vision_preset
from lit_trainer.modules.grpo import GRPOModule
from lit_trainer.modules.online_rl._rollout_buffer import RolloutBuffer
from lit_trainer.rewards import arithmetic_reward

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
G = 2
IMAGE_ID, PER_IMAGE = 384, 16  # tiny-vl: the <image> token, expanded to 16 tokens per 32x32 image
RED = np.array(builtin_shapes.COLOURS["red"], dtype=np.uint8)
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def noise_png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(image: Any) -> np.ndarray:
    return np.asarray(load_image(image, "test"))


def first_batch(data: PromptDataModule, rows: int) -> dict[str, Any]:
    """The first generation batch of ``rows`` prompt rows (each prompt G times), in dataset order."""
    return next(iter(data.generation_loader(RolloutGeometry(G, 1, rows, 1))))


# ------------------------------------------------------------------------------------------------- collation
def test_conversational_prompts_with_images_collated_by_hand():
    """String contents get their placeholders before the first user turn's text (TRL's rule); each <image> becomes
    16 image tokens; the prompts are left-padded; the image inputs are kept per row; a prompt repeated G times is
    processed once; the reward functions get the decoded images and the prompts with the images filled in."""
    from trl.data_utils import prepare_multimodal_messages

    processor, pngs = build_processor(), [noise_png(i) for i in range(3)]
    rows = Dataset.from_dict(
        {
            "images": [[pngs[0]], [pngs[1], pngs[2]]],
            "prompt": [[{"role": "user", "content": "Count."}], [{"role": "user", "content": "Compare."}]],
            "answer": ["1", "2"],
        }
    )
    data = PromptDataModule(
        tokenizer=processor, dataset=rows, batch_size=4, max_length=64, sampling="sequential", val_size=0
    )
    data.setup("fit")
    batch = first_batch(data, 4)
    tok = processor.tokenizer

    def expected(n: int, text: str) -> list[int]:
        head, tail = (
            tok("<|user|>\n", add_special_tokens=False),
            tok(f"{text}\n<|assistant|>\n", add_special_tokens=False),
        )
        return head["input_ids"] + [IMAGE_ID] * PER_IMAGE * n + tail["input_ids"]

    one, two = expected(1, "Count."), expected(2, "Compare.")
    assert len(two) - len(one) == PER_IMAGE + 2
    assert data.train_dataset["length"] == [len(one), len(two)]  # measured at setup without processing an image
    pad = [tok.pad_token_id] * (len(two) - len(one))
    assert batch["prompt_input_ids"].tolist() == [pad + one, pad + one, two, two]
    assert batch["prompt_attention_mask"].tolist() == [[0] * len(pad) + [1] * len(one)] * 2 + [[1] * len(two)] * 2

    packed, counts = batch[ROW_IMAGES + "pixel_values"], batch[ROW_IMAGES + "pixel_values.count"]
    assert packed.shape == (4, 2, 3, 32, 32) and counts.tolist() == [1, 1, 2, 2]
    single = [processor.image_processor(load_image(p, "t"), return_tensors="pt")["pixel_values"][0] for p in pngs]
    flat = model_image_inputs(batch)["pixel_values"]  # what generate and the log-probs get, in row order
    torch.testing.assert_close(flat, torch.stack([single[0], single[0], single[1], single[2], single[1], single[2]]))
    assert not packed[0, 1].any()  # the padding slot of a row with one image

    images = batch["reward_columns"]["images"]
    assert [len(i) for i in images] == [1, 1, 2, 2] and images[0][0] is images[1][0]  # processed once per prompt
    assert all(isinstance(i, Image.Image) for row in images for i in row)
    assert all(np.array_equal(np.asarray(i), pixels(p)) for i, p in zip(images[2], pngs[1:]))
    assert batch["reward_columns"]["answer"] == ["1", "1", "2", "2"]
    for prompt, row_images, raw in zip(batch["prompts"], images, [rows[0], rows[0], rows[1], rows[1]]):
        assert prompt == prepare_multimodal_messages(raw["prompt"], images=row_images)  # TRL's form, same images


def test_string_prompts_hold_the_image_token_and_bad_rows_are_named():
    processor, png = build_processor(), noise_png(0)
    data = PromptDataModule(
        tokenizer=processor, dataset=Dataset.from_dict({"image": [png], "prompt": ["<image>How many?"]}),
        batch_size=2, max_length=64, val_size=0,
    )  # fmt: skip
    batch = first_batch(data, 2)
    text = processor.tokenizer("How many?")["input_ids"]
    assert batch["prompt_input_ids"].tolist() == [[IMAGE_ID] * PER_IMAGE + text] * 2
    assert [np.array_equal(np.asarray(i), pixels(png)) for i in batch["reward_columns"]["image"]] == [True, True]

    bad = Dataset.from_dict({"image": [png, png], "prompt": ["<image>One", "<image><image>Two"]})
    with pytest.raises(ValueError, match=r"row 1.*2 '<image>' for 1 image"):
        PromptDataModule(tokenizer=processor, dataset=bad, max_length=64, val_size=0).setup("fit")
    with pytest.raises(ValueError, match="text-only model"):
        PromptDataModule(tokenizer="tiny", dataset=bad, max_length=64, val_size=0).setup("fit")


def test_image_inputs_follow_their_rows_through_the_buffer_shuffle():
    """Rows with 0, 1 and 2 images: after the seeded shuffle into micro-batches, each micro-batch's image inputs are
    its own rows' images, in its row order."""
    per_row = [
        {},
        {"pixel_values": torch.full((1, 3, 2, 2), 1.0)},
        {"pixel_values": torch.stack([torch.full((3, 2, 2), 2.0), torch.full((3, 2, 2), 3.0)])},
    ]
    per_row.append({"pixel_values": torch.full((1, 3, 2, 2), 4.0)})
    rows = {"prompt_ids": torch.arange(4).unsqueeze(1), "prompt_mask": torch.ones(4, 1, dtype=torch.long)}
    rows |= {
        "completion_ids": torch.ones(4, 1, dtype=torch.long),
        "completion_mask": torch.ones(4, 1, dtype=torch.long),
    }
    rows |= pack_row_images(per_row)
    slices = RolloutBuffer(2, 1).shuffle(rows, torch.Generator().manual_seed(3))
    seen = []
    for part in slices:
        order = part["prompt_ids"][:, 0].tolist()
        seen += order
        expected = [per_row[i]["pixel_values"] for i in order if per_row[i]]
        torch.testing.assert_close(model_image_inputs(part)["pixel_values"], torch.cat(expected))
    assert sorted(seen) == [0, 1, 2, 3] and seen != [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- against TRL
def noise_rows() -> Dataset:
    return Dataset.from_dict(
        {
            "images": [[noise_png(0)], [noise_png(1)]],
            "prompt": [builtin_shapes._user(), builtin_shapes._user()],
            "answer": ["1", "2"],
        }
    )


def length_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    length_reward.calls.append({"prompts": prompts, **kwargs})
    return [float(len(c[0]["content"])) for c in completions]


def without_images(prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": [{k: v for k, v in c.items() if k != "image"} for c in m["content"]]} for m in prompt]


@pytest.mark.slow  # importing trl and building its trainer takes several seconds
def test_prompt_ids_pixels_rewards_loss_and_gradients_equal_trl(tmp_path):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model, processor, rows = build_vision_preset(), build_processor(), noise_rows()
    initial = copy.deepcopy(model)  # TRL patches the model it trains (its fused log-prob head)
    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2 * G, num_generations=G,
        use_cpu=True, max_completion_length=6, loss_type="dapo", beta=0.0, bf16=False,
    )  # fmt: skip
    length_reward.calls = []
    trainer = GRPOTrainer(
        model=model, reward_funcs=[length_reward], args=args, train_dataset=rows, processing_class=processor
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which is not run here
    inputs = [{**row, "images": [load_image(i, "t") for i in row["images"]]} for row in rows for _ in range(G)]
    out = trainer._generate_and_score_completions(inputs)
    out["advantages"] = torch.tensor([1.0, 0.5, -0.3, 0.8])  # not summing to 0 per group: a non-zero loss

    batch = first_batch(PromptDataModule(tokenizer=processor, dataset=rows, batch_size=2 * G, max_length=64,
                                         sampling="sequential", val_size=0), 2 * G)  # fmt: skip
    assert torch.equal(batch["prompt_input_ids"], out["prompt_ids"])
    assert torch.equal(batch["prompt_attention_mask"], out["prompt_mask"])
    assert torch.equal(model_image_inputs(batch)["pixel_values"], out["pixel_values"])
    theirs = length_reward.calls[0]  # TRL's reward keywords: `images`, per completion a list of PIL images
    assert [[np.asarray(i).tolist() for i in row] for row in theirs["images"]] == [
        [np.asarray(i).tolist() for i in row] for row in batch["reward_columns"]["images"]
    ]
    assert [without_images(p) for p in theirs["prompts"]] == [without_images(p) for p in batch["prompts"]]
    assert all(p[0]["content"][0]["image"] is i[0] for p, i in zip(batch["prompts"], batch["reward_columns"]["images"]))

    reference = {}
    for dtype in (torch.float32, torch.float64):
        policy = copy.deepcopy(model).to(dtype)
        loss = trainer.compute_loss(policy, {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                                             for k, v in out.items()})  # fmt: skip
        loss.backward()
        grads = {
            n: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for n, p in policy.named_parameters()
        }
        reference[dtype] = (float(loss.detach()), grads)
    gradient = Rounding.of(reference[torch.float32][1], reference[torch.float64][1], what="gradient")

    micro = {"prompt_ids": batch["prompt_input_ids"], "prompt_mask": batch["prompt_attention_mask"]}
    micro |= {k: out[k] for k in ("completion_ids", "completion_mask", "advantages")}
    micro |= {k: v for k, v in batch.items() if k.startswith(ROW_IMAGES)}
    swapped = {**micro, ROW_IMAGES + "pixel_values": micro[ROW_IMAGES + "pixel_values"][[2, 3, 0, 1]]}

    def ours(rows: dict[str, Any], chunked: str) -> tuple[float, dict[str, torch.Tensor]]:
        module = GRPOModule(
            copy.deepcopy(initial), tokenizer=processor, reward_funcs=[length_reward], num_generations=G,
            max_completion_length=6, chunked_logits=chunked, train_vision_tower=True,
        )  # fmt: skip
        loss, _ = module.compute_loss(rows, out["completion_mask"].sum())
        loss.backward()
        grads = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
        return float(loss.detach()), {n: grads.get(n, torch.zeros_like(p)) for n, p in module.model.named_parameters()}

    mistake = relative_l2(ours(swapped, "off")[1], reference[torch.float32][1])  # another prompt's image
    own = Rounding.of(values([reference[torch.float32][0]]), values([reference[torch.float64][0]])).scale
    scale = Rounding(max(own, gradient.scale), what="loss")  # own may be 0: see the module docstring
    for chunked in ("off", "on"):
        loss, grads = ours(micro, chunked)
        gradient.check(grads, reference[torch.float32][1], mistake=mistake)
        scale.check(values([loss]), values([reference[torch.float32][0]]), mistake=abs(reference[torch.float32][0]))


# --------------------------------------------------------------------------------------------------- module
class FirstRound(L.Callback):
    """The first round's buffered rows, before the first optimizer step changes the policy."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if not hasattr(self, "rows"):
            self.rows = [dict(s) for s in pl_module._buffer.slices]


def red_squares(image: Image.Image) -> int:
    return int((np.asarray(image) == RED).all(-1).sum()) // builtin_shapes.SQUARE**2


def image_reward(prompts: list, completions: list, images: list, answer: list, **kwargs: Any) -> list[float]:
    """Checks TRL's form of the images (per completion a list of PIL images, the prompt's own) and rewards 0."""
    assert len(images) == len(completions) == len(prompts)
    for row, prompt, expected in zip(images, prompts, answer):
        assert isinstance(row, list) and len(row) == 1 and isinstance(row[0], Image.Image)
        assert red_squares(row[0]) == int(expected)  # the picture of this completion's own row
        assert prompt[0]["content"][0]["image"] is row[0]
    image_reward.calls += 1
    return [0.0] * len(completions)


@pytest.mark.slow  # builds the shapes data (4,200 pictures) and runs a round and a validation: 2-11 s measured
def test_two_steps_on_shapes_generate_and_score_with_the_images():
    """GRPOModule("tiny-vl") on builtin:shapes with arithmetic_reward: generate gets each prompt's pixel values; the
    stored old and reference log-probs (chunked head) are those of the rows' own images, and differ with another
    row's; the reward functions get the images; validation generates with them too."""
    torch.manual_seed(0)
    image_reward.calls = 0
    module = GRPOModule(
        "tiny-vl", reward_funcs=[arithmetic_reward, image_reward], num_generations=G, max_completion_length=3,
        steps_per_generation=2, beta=0.04, chunked_logits="on", learning_rate=1e-3, generation_seed=0,
    )  # fmt: skip
    generate, calls = module.model.generate, []

    def spy(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return generate(**kwargs)

    module.model.generate = spy
    data = PromptDataModule(tokenizer="tiny-vl", dataset="builtin:shapes", batch_size=4, max_length=64)
    first = FirstRound()
    trainer = L.Trainer(max_steps=2, limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0,
                        callbacks=[first], **QUIET)  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2 and image_reward.calls >= 2  # one training round (2 micro-steps) + validation
    assert len(calls) == 2 and all(c["pixel_values"].shape[1:] == (3, 32, 32) for c in calls)
    assert calls[0]["pixel_values"].shape[0] == calls[0]["input_ids"].shape[0] == 8  # one image per rollout
    assert (
        "suppress_tokens" in calls[0]["generation_config"].to_dict()
        and IMAGE_ID in calls[0]["generation_config"].suppress_tokens
    )  # as TRL: a sampled image token would have no image features

    for rows in first.rows:
        with torch.no_grad():
            own, _ = module.completion_logps(module.ref_model, rows)
            other = {**rows, ROW_IMAGES + "pixel_values": rows[ROW_IMAGES + "pixel_values"].roll(1, 0)}
            moved, _ = module.completion_logps(module.ref_model, other)
        mask = rows["completion_mask"].bool()
        # float32, the same forward (the policy before its first step equals the reference): rounding only
        torch.testing.assert_close(rows["ref_logps"][mask], own[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(rows["old_logps"][mask], own[mask], atol=1e-5, rtol=0)
        assert (moved - own)[mask].abs().max() > 1e-3  # the log-probs depend on the image


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number.
        b: the second number.

    Returns:
        The sum.
    """
    return a + b


@pytest.mark.parametrize(
    "option, match",
    [
        ({"max_staleness": 1}, "max_staleness"),
        ({"tools": [add]}, "tools"),
        ({"rollout_func": lambda prompts, module: {}}, "rollout_func"),
        ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ({"model": "tiny"}, "text-only model"),
    ],
)
def test_what_does_not_carry_images_is_refused_at_setup(option, match):
    rows = builtin_shapes.prompt_rows("validation").select(range(4))
    options = {"model": "tiny-vl", "reward_funcs": [arithmetic_reward], "num_generations": G, **option}
    module = GRPOModule(options.pop("model"), **options)
    data = PromptDataModule(tokenizer="tiny-vl", dataset=rows, batch_size=4, max_length=64, val_size=0)
    with pytest.raises(ValueError, match=match):
        L.Trainer(max_steps=1, **QUIET).fit(module, datamodule=data)
