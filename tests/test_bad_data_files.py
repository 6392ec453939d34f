"""Bad data files fail with ONE message naming the file, the row as an editor shows it (1-based line) and the problem.

Before: an empty ``.jsonl`` ended in a bare ``StopIteration``, an empty CSV cell in ``TypeError: can only concatenate
str (not "float") to str``, a malformed JSON line in ``DatasetGenerationError`` after three chained tracebacks.
"""

from __future__ import annotations

import json
import re

import pytest

from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule

# each data module with the columns of one good row
MODULES = {
    "sft": (SFTDataModule, {"prompt": "1+1=", "completion": "2"}),
    "preference": (PreferenceDataModule, {"prompt": "1+1=", "chosen": "2", "rejected": "3"}),
    "prompt": (PromptDataModule, {"prompt": "1+1=", "answer": "2"}),
}


def setup(kind: str, tokenizer, dataset: str) -> SFTDataModule:
    cls, _ = MODULES[kind]
    dm = cls(tokenizer=tokenizer, dataset=dataset, val_size=0, max_length=32)
    dm.setup("fit")
    return dm


def raises_one_message(match: str, kind: str, tokenizer, dataset: str) -> ValueError:
    with pytest.raises(ValueError, match=match) as info:
        setup(kind, tokenizer, dataset)
    error = info.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)  # no chain
    return error


def jsonl(rows: list) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_jsonl_names_the_file(tokenizer, tmp_path, kind, content):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    raises_one_message(rf"{re.escape(str(path))} is empty", kind, tokenizer, str(path))


@pytest.mark.parametrize("kind", MODULES)
def test_malformed_json_line_names_the_file_and_line(tokenizer, tmp_path, kind):
    good = MODULES[kind][1]
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl([good, good, "", json.dumps(good)[:-1], good]))  # line 4 lacks its closing brace
    error = raises_one_message(rf"line 4 of {re.escape(str(path))}: not valid JSON", kind, tokenizer, str(path))
    assert "Expecting ',' delimiter" in str(error)


def test_malformed_json_array_file_names_the_line(tokenizer, tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b"\n  {"text": "c"}\n]\n')
    raises_one_message(rf"line 4 of {re.escape(str(path))}: not valid JSON", "sft", tokenizer, str(path))


@pytest.mark.parametrize(("kind", "column"), [("sft", "completion"), ("preference", "chosen"), ("prompt", "prompt")])
def test_empty_csv_cell_names_the_file_line_and_column(tokenizer, tmp_path, kind, column):
    good = MODULES[kind][1]
    header = list(good)
    lines = [",".join(header)] + [",".join(good.values())] * 3
    lines[3] = ",".join("" if name == column else value for name, value in good.items())  # line 4: one empty cell
    path = tmp_path / "train.csv"
    path.write_text("\n".join(lines) + "\n")
    raises_one_message(
        rf"line 4 of {re.escape(str(path))}, column '{column}': the value is missing", kind, tokenizer, str(path)
    )


@pytest.mark.parametrize("kind", MODULES)
def test_missing_value_in_jsonl_counts_blank_lines(tokenizer, tmp_path, kind):
    good = MODULES[kind][1]
    column = "completion" if kind == "sft" else "rejected" if kind == "preference" else "prompt"
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl([good, "", good, {**good, column: None}]))  # the null is on line 4 (row 3)
    raises_one_message(
        rf"line 4 of {re.escape(str(path))}, column '{column}': the value is missing", kind, tokenizer, str(path)
    )


def test_non_text_value_is_named_with_its_type(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl([{"prompt": "1+1=", "completion": 2}]))
    raises_one_message(
        rf"line 1 of {re.escape(str(path))}, column 'completion': expected text, got int 2", "sft", tokenizer, str(path)
    )


def test_csv_cells_are_read_as_text(tokenizer, tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("prompt,completion\n1+1=,2\n05+05=,010\nNA+1=,NA\n")
    dm = setup("sft", tokenizer, str(path))
    decoded = sorted(bytes(t - 3 for t in ids[:-1]).decode() for ids in dm.train_dataset["input_ids"])
    assert decoded == ["05+05=010", "1+1=2", "NA+1=NA"]  # numbers are not parsed, "NA" is not a missing value


def test_quoted_multiline_csv_cell_keeps_line_numbers_right(tokenizer, tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('text,other\n"two\nlines",x\nok,y\n,z\n')  # records start on lines 2, 4, 5
    raises_one_message(
        rf"line 5 of {re.escape(str(path))}, column 'text': the value is missing", "sft", tokenizer, str(path)
    )


def test_error_in_a_directory_names_the_file_it_is_in(tokenizer, tmp_path):
    (tmp_path / "train-0.jsonl").write_text(jsonl([{"text": "a"}, {"text": "b"}]))
    (tmp_path / "train-1.jsonl").write_text(jsonl([{"text": "c"}, {"text": None}]))
    (tmp_path / "validation.jsonl").write_text(jsonl([{"text": "v"}]))
    raises_one_message(
        rf"line 2 of {re.escape(str(tmp_path / 'train-1.jsonl'))}, column 'text'", "sft", tokenizer, str(tmp_path)
    )
    (tmp_path / "train-1.jsonl").write_text(jsonl([{"text": "c"}]))
    (tmp_path / "validation.jsonl").write_text(jsonl([{"text": "v"}, "{oops"]))
    raises_one_message(
        rf"line 2 of {re.escape(str(tmp_path / 'validation.jsonl'))}: not valid JSON", "sft", tokenizer, str(tmp_path)
    )


def test_in_memory_rows_keep_their_index(tokenizer):
    from datasets import Dataset

    rows = Dataset.from_dict({"prompt": ["a", "b", "c"], "completion": ["x", None, "z"]})
    with pytest.raises(ValueError, match=r"row 1 of the train data, column 'completion': the value is missing"):
        SFTDataModule(tokenizer=tokenizer, dataset=rows, val_size=0).setup("fit")


@pytest.mark.parametrize("blank", [True, False])
def test_mixed_json_types_name_the_line_as_written(tokenizer, tmp_path, blank):
    # pyarrow refuses the type change (with a 0-based "row 1"), or datasets' fallback casts "1" to 1 so that the
    # loaded row 0 looks wrong: either way the message names the line as written
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl([{"prompt": "a", "completion": "1"}, *[""] * blank, {"prompt": "b", "completion": 2}]))
    line = 3 if blank else 2
    raises_one_message(
        rf"line {line} of {re.escape(str(path))}(: column 'completion' holds a number here but a "
        r"string on line 1|, column 'completion': expected text, got int 2)",
        "sft",
        tokenizer,
        str(path),
    )


def test_mixed_json_types_in_preference_data_name_the_line_as_written(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "a", "chosen": "1", "rejected": "x"}, {"prompt": "b", "chosen": 2, "rejected": "y"}]
    path.write_text(jsonl(rows))
    raises_one_message(
        rf"line 2 of {re.escape(str(path))}, column 'chosen': expected a string or a list of "
        "messages, got int",
        "preference",
        tokenizer,
        str(path),
    )


# one file per text format, with the byte 0xff (never valid in UTF-8) on line 2 at the given character
BAD_UTF8 = {
    "jsonl": (b'{"text": "1+1=2"}\n{"text": "2+2=\xff4"}\n{"text": "3+3=6"}\n', 15),
    "json": (b'[{"text": "1+1=2"},\n {"text": "2+2=\xff4"}]\n', 16),
    "csv": (b"prompt,completion\n2+2=\xff,4\n3+3=,6\n", 5),
    "txt": (b"1+1=2\n2+2=\xff4\n", 5),
}


@pytest.mark.parametrize("suffix", BAD_UTF8)
def test_invalid_utf8_names_the_file_line_and_byte(tokenizer, tmp_path, suffix):
    content, character = BAD_UTF8[suffix]
    path = tmp_path / f"train.{suffix}"
    path.write_bytes(content)
    error = raises_one_message(
        rf"line 2 of {re.escape(str(path))}: not valid UTF-8 \(byte 0xff at character {character}\)",
        "sft",
        tokenizer,
        str(path),
    )
    assert "iconv" in str(error)  # the fix


@pytest.mark.parametrize("kind", ["preference", "prompt"])
def test_invalid_utf8_in_preference_and_prompt_data(tokenizer, tmp_path, kind):
    good = MODULES[kind][1]
    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl([good, good, good]).encode() + b'{"prompt": "caf\xe9"}\n')  # latin-1 "café", line 4
    raises_one_message(rf"line 4 of {re.escape(str(path))}: not valid UTF-8 \(byte 0xe9", kind, tokenizer, str(path))


def test_invalid_utf8_is_found_across_read_chunks(tokenizer, tmp_path, monkeypatch):
    from lit_trainer.data import files

    monkeypatch.setattr(files, "_UTF8_CHUNK_BYTES", 7)  # chunk ends inside lines and inside the 2-byte "é"
    path = tmp_path / "train.txt"
    path.write_bytes("café au lait\nthé\n".encode() + b"ok\nno\xc3\n")  # line 4 ends in a truncated sequence
    raises_one_message(
        rf"line 4 of {re.escape(str(path))}: not valid UTF-8 \(byte 0xc3 at character 3\)", "sft", tokenizer, str(path)
    )
    path.write_bytes("café au lait\nthé\n".encode() + b"ok\nab\xff\n")
    raises_one_message(
        rf"line 4 of {re.escape(str(path))}: not valid UTF-8 \(byte 0xff at character 3\)", "sft", tokenizer, str(path)
    )
    path.write_bytes("café au lait\nthé ok\n".encode())  # valid UTF-8 split across chunks is accepted
    assert len(setup("sft", tokenizer, str(path)).train_dataset) == 2
