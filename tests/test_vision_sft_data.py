"""Vision-language SFT data (``SFTDataModule`` with ``tokenizer="tiny-vl"``) against TRL 1.16.

* The batches of every row format TRL's ``DataCollatorForVisionLanguageModeling`` accepts (conversations with string
  or structured contents, one or two images per row, ``assistant_only_loss``, conversational and string
  prompt/completion, ``text`` rows with ``<image>``) equal TRL's on the same processor and rows: token ids, attention
  mask, pixel values and labels, except the one decided difference: TRL trains language-modeling rows on their image
  tokens, we never do. (String rows end with EOS, as text rows do in both; TRL's vision path skips the preparation
  that appends it, so TRL's rows are given it here.) Our ``length`` column is each row's real length in the batch.
* The SFT loss and gradients of ``CausalLMModule("tiny-vl")`` on our batch equal TRL's ``SFTTrainer.compute_loss`` on
  TRL's batch (its image-token labels masked) within the float32 rounding of that computation.
* Every image format TRL accepts (``images`` lists or one ``image``; PIL images, paths, bytes, ``{"bytes", "path"}``,
  ``datasets``' ``Image`` feature) gives the same batch, and no image is decoded before its batch is built.
* Bad inputs are refused with their row named (a cut inside an image at setup); a text model trains rows whose image
  column is empty; validation exact match generates with the batch's images.
"""

from __future__ import annotations

import copy
import io
import os
import random
from typing import Any

import pytest
import torch
from datasets import Dataset, List
from datasets import Image as ImageFeature
from PIL import Image, ImageDraw

from helpers.rounding import Rounding, relative_l2, values
from lit_trainer import CausalLMModule
from lit_trainer.data import SFTDataModule
from lit_trainer.data.vision.collate import Encoded, image_token_ids, truncate
from lit_trainer.models import build_processor

trl = pytest.importorskip("trl")
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
IMAGE_ID = 384  # tiny-vl's <image> token
EOS = "</s>"


def picture(seed: int) -> bytes:
    """A small PNG, not square and not 32x32 (the processor resizes and crops it), with a patch that tells it apart."""
    rng = random.Random(seed)
    width, height = rng.choice([(40, 36), (24, 48), (50, 20), (33, 33)])
    colour = lambda: tuple(rng.randrange(256) for _ in range(3))
    image = Image.new("RGB", (width, height), colour())
    ImageDraw.Draw(image).rectangle((2, 3, width // 2, height // 2), fill=colour())
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def decoded(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


def turn(role: str, *parts: Any) -> dict[str, Any]:
    """A turn with structured contents: ``None`` is an image placeholder, a string a text part. (A ``datasets`` column
    cannot mix string and list contents, so a structured row is structured throughout.)"""
    return {"role": role, "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


def say(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


# Each case: rows (images as PNG bytes), our options, TRL's collator options, whether TRL's labels hold the image tokens
# (language-modeling rows) and the text TRL's string rows need to end like ours (we end a string row with EOS, as for
# text rows; TRL's vision path skips its dataset preparation, which is what appends that EOS for text data).
CASES = {
    "messages_strings": (
        [
            {"images": [picture(1)], "messages": [say("user", "How many?"), say("assistant", "3")]},
            {
                "images": [picture(2), picture(3)],
                "messages": [say("system", "Be brief."), say("user", "Which is red?"), say("assistant", "the left")],
            },
        ],
        {},
        {},
        True,
    ),
    "messages_structured": (
        [
            {
                "images": [picture(4), picture(5)],
                "messages": [
                    turn("user", "Look: ", None, " here."),
                    turn("assistant", "Seen."),
                    turn("user", None, "And this one?"),
                    turn("assistant", "Blue."),
                ],
            },
            {"images": [picture(6)], "messages": [turn("user", "Count ", None), turn("assistant", "2")]},
        ],
        {"pad_to_multiple_of": 16},
        {"pad_to_multiple_of": 16},
        True,
    ),
    "assistant_only_loss": (
        [
            {
                "images": [picture(7), picture(8)],
                "messages": [
                    turn("user", None, "First?"),
                    turn("assistant", "A"),
                    turn("user", None, "Then?"),
                    turn("assistant", "BB"),
                ],
            },
            {"images": [picture(9)], "messages": [turn("user", "What?", None), turn("assistant", "a square")]},
        ],
        {"assistant_only_loss": True},
        {"assistant_only_loss": True},
        False,
    ),
    "chat_prompt_completion": (
        [
            {
                "images": [picture(10)],
                "prompt": [say("system", "Count."), say("user", "Red ones?")],
                "completion": [say("assistant", "4")],
            },
            {
                "images": [picture(11), picture(12)],
                "prompt": [say("user", "Same?")],
                "completion": [say("assistant", "no")],
            },
        ],
        {},
        {"completion_only_loss": True},
        False,
    ),
    "text": (
        [
            {"images": [picture(13)], "text": "<image>Red squares: 3"},
            {"images": [picture(14), picture(15)], "text": "Left <image> right <image> same"},
        ],
        {},
        {},
        True,
    ),
    "prompt_completion": (
        [
            {"images": [picture(16)], "prompt": "<image>How many? ", "completion": "2"},
            {"images": [picture(17), picture(18)], "prompt": "<image><image>Same? ", "completion": "no"},
        ],
        {},
        {"completion_only_loss": True},
        False,
    ),
    "truncated_after_the_image": (  # 41 and 56 tokens cut to 30: the image tokens (positions 9-24) stay whole
        [
            {"images": [picture(19)], "messages": [say("user", "A question"), say("assistant", "an answer")]},
            {"images": [picture(20)], "messages": [say("user", "A longer question?"), say("assistant", "and more")]},
        ],
        {"max_length": 30},
        {"max_length": 30},
        True,
    ),
}


def for_trl(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``row`` as TRL's collator takes it: PIL images, and string rows ending with EOS as ours do."""
    row = copy.deepcopy(row)
    row["images"] = [decoded(png) for png in row["images"]]
    for key in ("text", "completion"):
        if isinstance(row.get(key), str):
            row[key] += EOS
    return row


def setup_data(rows: Dataset | list[dict[str, Any]], **options: Any) -> SFTDataModule:
    data = rows if isinstance(rows, Dataset) else Dataset.from_list(rows)
    options.setdefault("max_length", 512)
    dm = SFTDataModule(tokenizer=build_processor(), dataset=data, validation_dataset=data, **options)
    dm.setup("fit")
    return dm


def our_batch(dm: SFTDataModule, train: bool = True) -> dict[str, torch.Tensor]:
    data = dm.train_dataset if train else dm.val_dataset
    return dm._collate([data[i] for i in range(len(data))], train)


def trl_batch(rows: list[dict[str, Any]], **options: Any) -> dict[str, torch.Tensor]:
    collator = DataCollatorForVisionLanguageModeling(build_processor(), **options)
    return dict(collator([for_trl(row) for row in rows]))


@pytest.mark.parametrize("case", list(CASES))
def test_batches_match_trl_but_image_tokens_are_never_targets(case):
    rows, ours_options, trl_options, trl_trains_images = CASES[case]
    dm = setup_data(rows, **ours_options)
    ours, theirs = our_batch(dm), trl_batch(rows, **trl_options)

    assert set(ours) == set(theirs) == {"input_ids", "attention_mask", "labels", "pixel_values"}
    for key in ("input_ids", "attention_mask", "pixel_values"):
        assert torch.equal(ours[key], theirs[key]), key
    image = theirs["input_ids"] == IMAGE_ID
    assert image.sum() == 16 * sum(len(row["images"]) for row in rows)  # every image whole: 16 tokens each
    # The one difference: TRL trains language-modeling rows on their image tokens; we train on none of them.
    assert (ours["labels"][image] == -100).all()
    assert torch.equal(ours["labels"] != theirs["labels"], image & (theirs["labels"] != -100))
    assert (theirs["labels"][image] != -100).all() if trl_trains_images else (theirs["labels"][image] == -100).all()
    assert (ours["labels"] != -100).any()
    # the `length` column (samplers, position check) is each row's real length in the batch
    assert dm.train_dataset["length"] == ours["attention_mask"].sum(1).tolist()
    assert dm.lengths() == dm.train_dataset["length"] and dm.longest_row() == max(dm.lengths())


def float64_sft(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The exact (float64) SFT loss of ``batch`` and its gradients: the mean next-token cross-entropy over the labels
    that are not -100, on the unpatched model's logits (TRL's fused head computes its log-probs in float32 whatever the
    weights' dtype, so TRL's own float64 run would not be one)."""
    net = copy.deepcopy(model).double().train()
    pixels = batch["pixel_values"].double()
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=pixels).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    loss.backward()
    return values([loss.item()]), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


def test_sft_loss_and_gradients_match_trl(tmp_path):
    """One batch's loss and gradients: ours (``CausalLMModule.compute_loss``) on our batch, TRL's
    ``SFTTrainer.compute_loss`` on TRL's batch with its image-token labels masked. Bound: 4x how far TRL's float32
    result lies from the float64 one (measured: loss 1.5e-7 relative, gradients 3.6e-7 relative L2; ours lies 1.6e-7
    and 1.8e-7 from TRL's); the mistake it must tell apart: TRL's result with the image tokens trained (loss 2.1e-3,
    gradients 2.0 relative)."""
    rows = CASES["messages_strings"][0]
    torch.manual_seed(0)
    module = CausalLMModule("tiny-vl")
    model = copy.deepcopy(module.model)
    ours = our_batch(setup_data(rows))
    exact = float64_sft(model, ours)

    module.model.zero_grad()
    loss, _ = module.compute_loss(ours, None)
    loss.backward()
    our_result = values([loss.item()]), {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}

    args = trl.SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_length=None)
    trainer = trl.SFTTrainer(
        model=copy.deepcopy(model), args=args, train_dataset=Dataset.from_list([for_trl(r) for r in rows]),
        processing_class=build_processor(),
    )  # fmt: skip
    theirs = trainer.data_collator([for_trl(r) for r in rows])
    masked = {**theirs, "labels": theirs["labels"].masked_fill(theirs["input_ids"] == IMAGE_ID, -100)}
    assert torch.equal(ours["labels"], masked["labels"])

    def trl_result(batch: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        net = copy.deepcopy(trainer.model).train()  # TRL's model: its fused LM head added
        result = trainer.compute_loss(net, dict(batch))
        result.backward()
        return values([result.item()]), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    trl_masked, trl_images_trained = trl_result(masked), trl_result(theirs)
    for index, what in ((0, "loss"), (1, "gradients")):
        assert set(our_result[index]) == set(trl_masked[index]) == set(exact[index])
        Rounding.of(trl_masked[index], exact[index], what=what).check(
            our_result[index], trl_masked[index], mistake=relative_l2(trl_images_trained[index], trl_masked[index])
        )


def chat(images: Any, question: str = "How many?", column: str = "images") -> dict[str, Any]:
    return {column: images, "messages": [say("user", question), say("assistant", "2")]}


IMAGE_KINDS = ("pil", "path", "bytes", "bytes_path_dict", "image_feature")


def image_rows(kind: str, column: str, pngs: list[list[bytes]], folder) -> Dataset:
    """The rows of ``pngs`` (the images of each row) with their images given as ``kind``, in ``column`` (``image``:
    the one image of each row)."""
    cells = []
    for r, row in enumerate(pngs):
        paths = [folder / f"{kind}_{r}_{i}.png" for i in range(len(row))]
        for path, png in zip(paths, row):
            path.write_bytes(png)
        cells.append(
            {
                "pil": [decoded(png) for png in row],
                "path": [str(path) for path in paths],
                "image_feature": [str(path) for path in paths],
                "bytes": list(row),
                "bytes_path_dict": [{"bytes": png, "path": None} for png in row],
            }[kind]
        )
    single = column == "image"
    data = Dataset.from_list([chat(cell[0] if single else cell, f"Row {r}?", column) for r, cell in enumerate(cells)])
    if kind == "image_feature":
        data = data.cast_column(column, ImageFeature() if single else List(ImageFeature()))
    return data


@pytest.mark.parametrize("column", ["images", "image"])
def test_every_image_format_gives_the_same_batch_and_stays_undecoded(column, tmp_path):
    pngs = [[picture(21)], [picture(22), picture(23)] if column == "images" else [picture(22)]]
    reference = our_batch(setup_data([chat(row, f"Row {r}?") for r, row in enumerate(pngs)]))
    for kind in IMAGE_KINDS:
        data = image_rows(kind, column, pngs, tmp_path)
        if kind in ("pil", "image_feature"):  # `datasets` stores PIL images with its Image feature, decoded on read
            assert isinstance(data[0][column][0] if column == "images" else data[0][column], Image.Image)
        dm = setup_data(data)
        batch = our_batch(dm)
        assert set(batch) == set(reference), kind
        for key in reference:
            assert torch.equal(batch[key], reference[key]), (kind, key)
        # lazily loaded: after setup the rows hold what the dataset held (paths, bytes; an Image feature undecoded)
        for split in (dm.train_dataset, dm.val_dataset):
            feature = split.features[column]
            feature = feature if column == "image" else feature.feature
            assert not isinstance(feature, ImageFeature) or not feature.decode, kind
            for row in split:
                cells = [row[column]] if column == "image" else row[column]
                assert cells and not any(isinstance(cell, Image.Image) for cell in cells), kind
                if kind in ("path", "bytes"):
                    assert all(isinstance(cell, str if kind == "path" else bytes) for cell in cells)
                elif kind == "image_feature":  # cast from paths: the files are read when the batch is built
                    assert all(cell["bytes"] is None and cell["path"].endswith(".png") for cell in cells)
                else:  # PIL images are stored by `datasets` as PNG bytes
                    assert all(isinstance(cell["bytes"], bytes) for cell in cells)


def write(path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


# name: (rows from a temporary folder, options, when it fails: at setup or when the batch is built, the message)
BAD_INPUTS = {
    "missing_file": (
        lambda tmp: [chat([write(tmp / "a.png", picture(0))]), chat([str(tmp / "missing.png")])],
        {},
        "setup",
        r"Bad image at row 1 of the train data, column 'images': the image file '.*missing\.png' does not exist",
    ),
    "garbage_bytes": (
        lambda tmp: [chat([picture(0)]), chat([b"not a png"])],
        {},
        "batch",
        r"row 1 of the train data: 9 bytes do not decode as an image",
    ),
    "text_file_named_png": (
        lambda tmp: [chat([write(tmp / "a.png", picture(0))]), chat([write(tmp / "notes.png", b"hello")])],
        {},
        "batch",
        r"row 1 of the train data: the file '.*notes\.png' does not decode as an image",
    ),
    "more_placeholders_than_images": (
        lambda tmp: [
            {"images": [picture(0)], "messages": [turn("user", None, "Hi"), turn("assistant", "2")]},
            {"images": [picture(1)], "messages": [turn("user", None, None, "Hi"), turn("assistant", "2")]},
        ],
        {},
        "setup",
        r"row 1 of the train data: 2 image placeholder\(s\) for 1 image\(s\) \(more placeholders than images\)",
    ),
    "fewer_placeholders_than_images": (
        lambda tmp: [
            {"images": [picture(0), picture(1)], "messages": [turn("user", None, "Hi"), turn("assistant", "2")]}
        ],
        {},
        "setup",
        r"row 0 of the train data: 1 image placeholder\(s\) for 2 image\(s\) \(fewer placeholders than images\)",
    ),
    "text_more_placeholders_than_images": (
        lambda tmp: [{"images": [picture(0)], "text": "<image>A"}, {"images": [picture(1)], "text": "<image><image>B"}],
        {},
        "setup",
        r"row 1 of the train data: the text holds 2 '<image>' for 1 image\(s\)",
    ),
    "text_fewer_placeholders_than_images": (
        lambda tmp: [{"images": [picture(0), picture(1)], "text": "<image>A"}],
        {},
        "setup",
        r"row 0 of the train data: the text holds 1 '<image>' for 2 image\(s\)",
    ),
    "no_user_turn_for_the_images": (
        lambda tmp: [{"images": [picture(0)], "messages": [say("system", "Hi"), say("assistant", "2")]}],
        {},
        "setup",
        r"row 0 of the train data: 1 image\(s\) but no user turn to hold them",
    ),
    "text_only_model": (
        lambda tmp: [chat([]), chat([picture(0)])],
        {"tokenizer": "tiny"},
        "setup",
        r"has images \(row 1 of the train data, column 'images'\) but the tokenizer is a text-only model's",
    ),
    "packing_bfd": (
        lambda tmp: [chat([picture(0)])],
        {"packing": "bfd"},
        "setup",
        r"`packing='bfd'` is not supported for rows with images: a packed row would need each image's tokens",
    ),
    "packing_padding_free": (
        lambda tmp: [chat([picture(0)])],
        {"packing": "padding_free"},
        "setup",
        r"`packing='padding_free'` is not supported for rows with images",
    ),
    "truncation_would_cut_an_image": (  # row 0's image ends at token 25 (kept, the row cut at 30); row 1's after 50
        lambda tmp: [
            {"images": [picture(0)], "messages": [say("user", "Hi"), say("assistant", "2")]},
            {
                "images": [picture(1)],
                "messages": [say("system", "Count the squares."), say("user", "Hi"), say("assistant", "2")],
            },
        ],
        {"max_length": 30},
        "setup",
        r"row 1 of the train data: 74 tokens with its image tokens, more than max_length=30, and cutting it would cut",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_refused_naming_the_row(case, tmp_path):
    """Each bad input is refused with its row named: at setup when it can be told without decoding an image, else
    when its batch is built (an image that does not decode: decoding at setup would load every image twice)."""
    make_rows, options, when, message = BAD_INPUTS[case]
    data = Dataset.from_list(make_rows(tmp_path))
    dm = SFTDataModule(
        tokenizer=options.pop("tokenizer", build_processor()), dataset=data, validation_dataset=data, **options
    )
    if when == "setup":
        with pytest.raises(ValueError, match=message):
            dm.setup("fit")
        return
    dm.setup("fit")
    with pytest.raises(ValueError, match=message):
        our_batch(dm)


def test_a_text_model_trains_on_rows_whose_image_column_holds_no_image():
    """A text-only tokenizer refuses rows with images (above) but not an image column without any image: those rows
    are text rows (the column is dropped). TRL refuses any dataset with an image column for a text model."""
    rows = [chat([], "How many?"), chat([], "And now?")]
    batches = []
    for data in (Dataset.from_list(rows), Dataset.from_list(rows).remove_columns("images")):
        dm = SFTDataModule(tokenizer="tiny", dataset=data, validation_dataset=data, max_length=64)
        dm.setup("fit")
        batches.append(our_batch(dm))
    assert set(batches[0]) == {"input_ids", "attention_mask", "labels"}
    assert all(torch.equal(batches[0][key], batches[1][key]) for key in batches[1])


def solid(colour: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_validation_exact_match_generates_with_the_images():
    """After 20 steps on two rows whose answer is the image's colour (a red image: "r", a blue one: "b"), the
    validation exact match generates from the prompts with the batch's pixel values: 1.0 with the rows' own images,
    0.0 with the two images swapped (the prompts' text is the same)."""
    torch.manual_seed(0)
    module = CausalLMModule("tiny-vl", eval_exact_match=True, eval_max_new_tokens=3)
    rows = [
        {"images": [solid(c)], "messages": [say("user", "Colour?"), say("assistant", c[0])]} for c in ("red", "blue")
    ]
    dm = setup_data(rows, assistant_only_loss=True)
    train, validation = our_batch(dm), our_batch(dm, train=False)
    assert torch.equal(validation["prompt_input_ids"][0], validation["prompt_input_ids"][1])
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=3e-3)
    for _ in range(20):  # measured: the loss falls from 3.3 to 0.06
        loss, _ = module.compute_loss(train, None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    calls = []
    generate = module.model.generate
    module.model.generate = lambda **kw: calls.append(kw) or generate(**kw)
    exact_match = module.eval().val_metrics["exact_match"]

    def validation_exact_match(batch: dict[str, torch.Tensor]) -> float:
        exact_match.reset()
        with torch.no_grad():
            module.validation_step(batch, 0)
        assert torch.equal(calls[-1]["pixel_values"], batch["pixel_values"])
        return float(exact_match.compute())

    assert validation_exact_match(validation) == 1.0
    assert validation_exact_match({**validation, "pixel_values": validation["pixel_values"].flip(0)}) == 0.0


def test_the_collator_refuses_a_cut_inside_an_image():
    """The batch-time check behind the setup one (for processors whose image token count is only estimated at setup):
    a row is cut after its images, never inside one."""
    image_ids = image_token_ids(build_processor())
    row = lambda: Encoded(ids=[5, 6] + [IMAGE_ID] * 16 + [7, 8, 9], targets=[1] * 21, prompt_length=0)
    cut = row()
    assert truncate(cut, 19, image_ids, "row 3 of the train data") and cut.ids == row().ids[:19]
    with pytest.raises(ValueError, match=r"row 3 of the train data: 21 tokens .* max_length=17, .* would cut an image"):
        truncate(row(), 17, image_ids, "row 3 of the train data")
