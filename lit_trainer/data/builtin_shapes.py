"""The built-in image task: how many red squares are in a 32x32 picture? Generated with PIL, deterministic from a
seed, no download.

Each picture is a 4x4 grid of 8x8 cells (the ``tiny-vl`` preset's patches) on a white background; 1 to 5 cells hold a
6x6 square, each red, green or blue, and 0 to 4 of them are red (one of every answer in five pictures). The question
is ``"How many red squares?"`` and the answer a digit. The validation pictures come from another seed and never
appear in training. The same pictures serve three formats:

* SFT rows (``builtin:shapes``): ``images`` (one PNG, as bytes), ``messages`` = user question, assistant answer,
  and ``answer``;
* preference rows: ``prompt`` (the user turn), ``chosen`` (the right count) and ``rejected`` (one off) assistant
  turns, and ``images``;
* prompt rows (GRPO): ``prompt`` (the user turn), ``images`` and ``answer``, for a verifier reward such as
  :func:`~lit_trainer.rewards.arithmetic_reward` (exact match).
"""

from __future__ import annotations

import io
import random
from typing import Literal

from datasets import Dataset
from PIL import Image, ImageDraw

Split = Literal["train", "validation"]
QUESTION = "How many red squares?"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220)}
CELL, GRID, SQUARE = 8, 4, 6
TRAIN_ROWS, VALIDATION_ROWS = 4000, 200
_SEEDS = {"train": 1234, "validation": 4321}


def draw(squares: list[tuple[int, str]]) -> bytes:
    """A PNG of ``squares``: ``(cell index 0..15, colour name)`` each."""
    image = Image.new("RGB", (CELL * GRID, CELL * GRID), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    offset = (CELL - SQUARE) // 2
    for cell, colour in squares:
        x, y = (cell % GRID) * CELL + offset, (cell // GRID) * CELL + offset
        pen.rectangle((x, y, x + SQUARE - 1, y + SQUARE - 1), fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def pictures(split: Split, count: int | None = None) -> list[tuple[bytes, int]]:
    """``(png, red count)`` of one split, deterministic."""
    rng = random.Random(_SEEDS[split])
    count = count if count is not None else (TRAIN_ROWS if split == "train" else VALIDATION_ROWS)
    out = []
    for i in range(count):
        red = i % 5  # every answer equally often
        others = rng.randint(max(0, 1 - red), 5 - red)
        colours = ["red"] * red + [rng.choice(("green", "blue")) for _ in range(others)]
        cells = rng.sample(range(GRID * GRID), len(colours))
        out.append((draw(list(zip(cells, colours))), red))
    rng.shuffle(out)
    return out


def _user() -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def _assistant(text: str) -> list[dict[str, object]]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def sft_rows(split: Split) -> Dataset:
    """``images``, ``messages`` (question, answer) and ``answer`` rows."""
    data = pictures(split)
    return Dataset.from_dict(
        {
            "images": [[png] for png, _ in data],
            "messages": [_user() + _assistant(str(red)) for _, red in data],
            "answer": [str(red) for _, red in data],
        }
    )


def preference_rows(split: Split) -> Dataset:
    """``images``, ``prompt``, ``chosen`` (the count), ``rejected`` (one off) and ``answer`` rows."""
    data = pictures(split)
    return Dataset.from_dict(
        {
            "images": [[png] for png, _ in data],
            "prompt": [_user() for _ in data],
            "chosen": [_assistant(str(red)) for _, red in data],
            "rejected": [_assistant(str(red + 1 if red < 4 else red - 1)) for _, red in data],
            "answer": [str(red) for _, red in data],
        }
    )


def prompt_rows(split: Split) -> Dataset:
    """``images``, ``prompt`` (the user turn) and ``answer`` rows."""
    data = pictures(split)
    return Dataset.from_dict(
        {"images": [[png] for png, _ in data], "prompt": [_user() for _ in data], "answer": [str(r) for _, r in data]}
    )
