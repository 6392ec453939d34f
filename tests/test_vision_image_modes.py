"""Pictures in every PIL mode reach the model as transformers' processor makes them at inference (``tiny-vl``).

The reference is the processor's own output on the original picture: its ``convert_to_rgb`` composites transparency
(an alpha band, or a ``transparency`` key of P and RGB pictures) onto white, where PIL's ``convert("RGB")`` turns it
black. For each mode (RGBA, P with a transparent index or per-index alphas, RGB with a transparent colour, LA, L,
I;16, I, F, CMYK, 1), stored as the bytes of a file that keeps its mode, the pixel values of our SFT, DPO and GRPO
batches equal the processor's on the original. GRPO's reward functions get the pictures as ``datasets`` decodes them
(TRL 1.16 passes the dataset's images as they are), not RGB copies. A mode transformers itself cannot process (PIL's
``La``) is refused naming the row, the mode and the fix.
"""

from __future__ import annotations

import io
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from datasets import Dataset, List
from datasets import Image as ImageFeature
from PIL import Image

from lit_trainer.data import PreferenceDataModule, SFTDataModule
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.data.vision.collate import VisionSFTCollator
from lit_trainer.data.vision.preference import VisionPreferenceCollator
from lit_trainer.data.vision.prompt import VisionPromptEncoder, model_image_inputs
from lit_trainer.data.vision.rows import ROW_KEY
from lit_trainer.models import build_processor
from lit_trainer.modules.grpo import GRPOModule

HEIGHT, WIDTH = 36, 40  # not square and not 32x32: the processor resizes and crops
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def _channels() -> tuple[np.ndarray, np.ndarray]:
    """Random colours and an alpha band: the top half transparent, a half-transparent strip, the rest opaque."""
    rgb = np.random.default_rng(0).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    alpha = np.full((HEIGHT, WIDTH), 255, dtype=np.uint8)
    alpha[: HEIGHT // 2] = 0
    alpha[HEIGHT // 2 : HEIGHT // 2 + 6] = 100
    return rgb, alpha


def _palette(transparency: Any) -> Image.Image:
    image = Image.fromarray(_channels()[0]).quantize(16)
    image.info["transparency"] = int(np.asarray(image)[0, 0]) if transparency == "index" else transparency
    return image


def _rgb_with_a_transparent_colour() -> Image.Image:
    rgb = _channels()[0].copy()
    rgb[:10] = (7, 8, 9)
    image = Image.fromarray(rgb)
    image.info["transparency"] = (7, 8, 9)
    return image


def original(mode: str) -> Image.Image:
    rgb, alpha = _channels()
    gray = rgb[..., 0]
    build = {
        "RGBA": lambda: Image.fromarray(np.dstack([rgb, alpha]), "RGBA"),
        "P, transparent index": lambda: _palette("index"),
        "P, alpha per index": lambda: _palette(bytes([0, 60, 120, 180] * 4)),
        "RGB, transparent colour": _rgb_with_a_transparent_colour,
        "LA": lambda: Image.fromarray(np.dstack([gray, alpha]), "LA"),
        "L": lambda: Image.fromarray(gray, "L"),
        "I;16": lambda: Image.fromarray(gray.astype(np.uint16) * 257, "I;16"),
        "I": lambda: Image.fromarray(gray.astype(np.int32) * 1000 - 50000, "I"),
        "F": lambda: Image.fromarray(gray.astype(np.float32) / 200, "F"),
        "CMYK": lambda: Image.fromarray(np.dstack([rgb, gray]), "CMYK"),
        "1": lambda: Image.fromarray(gray > 127),
    }
    return build[mode]()


TRANSPARENT = ["RGBA", "P, transparent index", "P, alpha per index", "RGB, transparent colour", "LA"]
MODES = [*TRANSPARENT, "L", "I;16", "I", "F", "CMYK", "1"]


def same_picture(a: Image.Image, b: Image.Image) -> bool:
    return (
        a.mode == b.mode
        and a.size == b.size
        and np.array_equal(np.asarray(a), np.asarray(b))
        and a.info.get("transparency") == b.info.get("transparency")
    )


def file_bytes(image: Image.Image) -> bytes:
    """The picture as the bytes of a file that keeps its mode, pixels and transparency (checked)."""
    buffer = io.BytesIO()
    image.save(buffer, format="TIFF" if image.mode in ("I", "F", "CMYK") else "PNG")
    data = buffer.getvalue()
    assert same_picture(Image.open(io.BytesIO(data)), image)
    return data


def pixel_values(processor, image: Image.Image) -> torch.Tensor:
    """transformers' own processing of ``image`` (the processor's image processor), as at inference."""
    return processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]


@pytest.fixture(scope="module")
def processor():
    return build_processor()


@pytest.fixture(scope="module")
def expected(processor) -> torch.Tensor:
    """The processor's pixel values of each original picture (one per mode), as at inference."""
    return torch.cat([pixel_values(processor, original(mode)) for mode in MODES])


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return [file_bytes(original(m)) for m in MODES]


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def answer(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text}]


def test_the_reference_composites_transparency_onto_white(processor, expected):
    """The check has teeth: on each picture with transparency the processor's pixels differ from the colours of PIL's
    ``convert("RGB")`` without the transparency (black, or the palette's colour, where transparent), and white shows
    where the RGBA picture is transparent. (``convert("RGB")`` of a P picture with one transparent index keeps it as a
    ``transparency`` colour, which the processor still composites; of one with an alpha per index it drops them.)"""
    for mode, pixels in zip(MODES, expected):
        dropped = pixel_values(processor, Image.fromarray(np.asarray(original(mode).convert("RGB"))))
        assert torch.equal(pixels, dropped[0]) == (mode not in TRANSPARENT), mode
    white = pixel_values(processor, Image.new("RGB", (WIDTH, HEIGHT), "white"))
    assert torch.equal(expected[0, :, 0], white[0, :, 0])  # the first (transparent) row is white


@pytest.mark.parametrize("source", ["bytes", "image feature"])
def test_sft_pixels_equal_the_processors_on_the_original(processor, expected, blobs, source):
    rows = Dataset.from_dict({"images": [[b] for b in blobs], "messages": [ask("What?") + answer("ok")] * len(MODES)})
    if source == "image feature":
        rows = rows.cast_column("images", List(ImageFeature()))
    dm = SFTDataModule(tokenizer=processor, dataset=rows, val_size=0, max_length=64)
    dm.setup("fit")
    kept = [dm.train_dataset[i] for i in range(len(MODES))]
    assert [row[ROW_KEY] for row in kept] == list(range(len(MODES)))
    pixels = dm._collate(kept, True)["pixel_values"]
    for mode, ours, theirs in zip(MODES, pixels, expected):
        assert torch.equal(ours, theirs), mode


def test_dpo_pixels_equal_the_processors_on_the_original(processor, expected, blobs):
    n = len(MODES)
    rows = Dataset.from_dict(
        {"images": [[b] for b in blobs], "prompt": [ask("What?")] * n}
        | {"chosen": [answer("a")] * n, "rejected": [answer("b")] * n}
    )
    dm = PreferenceDataModule(tokenizer=processor, dataset=rows, val_size=0, max_length=64)
    dm.setup("fit")
    kept = [dm.train_dataset[i] for i in range(n)]
    assert [row[ROW_KEY] for row in kept] == list(range(n))
    pixels = dm._collate(kept, True)["pixel_values"]  # the chosen rows, then the rejected rows: each picture twice
    assert torch.equal(pixels, torch.cat([expected, expected]))


def test_grpo_pixels_equal_the_processors_and_the_rewards_get_the_pictures_as_datasets_decodes_them(
    processor, expected, blobs
):
    """The prompts' pixel values are the processor's on the originals; the reward functions' ``images`` (and the
    images filled into the prompts) are what TRL passes them: the dataset's pictures as ``datasets`` decodes them,
    each in its own mode with its transparency."""
    rows = Dataset.from_dict({"images": [[b] for b in blobs], "prompt": [ask("What?")] * len(MODES)})
    rows = rows.cast_column("images", List(ImageFeature()))
    data = PromptDataModule(tokenizer=processor, dataset=rows, val_size=0, max_length=64)
    data.setup("fit")
    kept = [data.train_dataset[i] for i in range(len(MODES))]
    assert [row[ROW_KEY] for row in kept] == list(range(len(MODES)))
    batch = data._collate(kept, True)
    assert torch.equal(model_image_inputs(batch)["pixel_values"], expected)
    trl_images = [rows[i]["images"] for i in range(len(MODES))]  # datasets' decoding: what TRL's reward functions get
    for mode, ours, theirs, prompt in zip(MODES, batch["reward_columns"]["images"], trl_images, batch["prompts"]):
        assert len(ours) == len(theirs) == 1 and same_picture(ours[0], theirs[0]), mode
        assert same_picture(ours[0], original(mode)), mode
        assert prompt[0]["content"][0]["image"] is ours[0]


# a row of every collator's format: string contents get their image placeholders before the first user turn (TRL's
# rule); a string prompt holds the image token once per image
ROW = {"messages": ask("What?") + answer("ok"), "prompt": ask("What?"), "chosen": answer("a")}
ROW |= {"rejected": answer("b"), ROW_KEY: 0}


def _collators(processor) -> dict[str, Any]:
    return {
        "sft": VisionSFTCollator(processor, "messages", {"messages": "messages"}, "images", 64),
        "dpo": VisionPreferenceCollator(processor, "images", 64),
        "grpo": VisionPromptEncoder(processor, "images", "prompt", conversational=True),
        "grpo, string prompt": VisionPromptEncoder(processor, "images", "text", conversational=False),
    }


@pytest.mark.parametrize("path", ["sft", "dpo", "grpo", "grpo, string prompt"])
def test_pil_pictures_in_rows_reach_the_processor_unconverted(processor, expected, path):
    """Rows that hold PIL images (not files): the same pixel values, and GRPO keeps the very objects."""
    collate = _collators(processor)[path]
    for mode, theirs in zip(MODES, expected):
        picture = original(mode)
        row = {**ROW, "images": [picture], "text": "<image>What?"}
        if path.startswith("grpo"):
            (encoded,) = collate([row])
            assert encoded.pictures[0] is picture
            pixels = encoded.images["pixel_values"]
        else:
            pixels = collate([row])["pixel_values"]
        assert torch.equal(pixels[0], theirs), (path, mode)


@pytest.mark.parametrize("path", ["sft", "dpo", "grpo", "grpo, string prompt"])
def test_a_mode_transformers_cannot_process_is_refused_naming_the_row_and_the_mode(processor, path):
    """PIL's ``La`` (luminance with premultiplied alpha): transformers' conversion raises ("conversion from La to L
    not supported"); the error names the row, the picture, its mode and the fix."""
    rgb, alpha = _channels()
    bad = Image.fromarray(np.dstack([rgb[..., 0], alpha]), "LA").convert("La")
    with pytest.raises(ValueError, match="La"):
        pixel_values(processor, bad)  # transformers itself fails on it
    row = {**ROW, ROW_KEY: 3, "images": [original("RGBA"), bad], "text": "<image><image>What?"}
    with pytest.raises(ValueError, match=r"^row 3 of the train (prompt )?data: image 1 \(PIL mode 'La', 40x36\).*"
                                         r"Convert that picture to a mode the processor takes"):  # fmt: skip
        _collators(processor)[path]([row])


def test_a_processor_error_of_another_cause_still_names_the_row(processor):
    row = {**ROW, ROW_KEY: 2, "images": [original("RGBA")], "text": "<image><image>What?"}
    with pytest.raises(ValueError, match=r"^row 2 of the train prompt data: .*2 <image> tokens.*1 images"):
        _collators(processor)["grpo, string prompt"]([row])


def test_grpo_reward_functions_get_the_original_pictures(blobs):
    """One GRPO step of ``tiny-vl``: the reward function's ``images`` and the images of its prompts are the
    dataset's pictures as ``datasets`` decodes them (mode and transparency kept), each completion its own row's."""
    modes = ["RGBA", "P, alpha per index"]
    rows = Dataset.from_dict(
        {"images": [[blobs[MODES.index(m)]] for m in modes], "prompt": [ask("What?")] * 2, "mode": modes}
    ).cast_column("images", List(ImageFeature()))
    seen: list[tuple[list, list, list]] = []

    def capture(prompts: list, completions: list, images: list, mode: list, **kwargs: Any) -> list[float]:
        seen.append((prompts, images, mode))
        return [float(len(str(c))) for c in completions]

    torch.manual_seed(0)
    module = GRPOModule("tiny-vl", reward_funcs=[capture], num_generations=2, max_completion_length=2)
    data = PromptDataModule(tokenizer="tiny-vl", dataset=rows, batch_size=4, max_length=64, val_size=0)
    L.Trainer(max_steps=1, limit_val_batches=0, **QUIET).fit(module, datamodule=data)
    assert seen
    for prompts, images, row_modes in seen:
        assert len(prompts) == len(images) == len(row_modes) == 4  # 2 prompts x 2 generations
        for prompt, (picture,), mode in zip(prompts, images, row_modes):
            assert same_picture(picture, original(mode)), (mode, picture.mode)
            assert prompt[0]["content"][0]["image"] is picture
    assert {mode for _, _, row_modes in seen for mode in row_modes} == set(modes)
