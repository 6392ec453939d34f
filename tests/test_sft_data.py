import json

import pytest
import torch
from datasets import Dataset

from lit_trainer.data.loader import NUM_ITEMS_KEY, TrainLoader
from lit_trainer.data.samplers.batch_sampler import ShardedBatchSampler
from lit_trainer.data.sft import SFTDataModule


def _dm(tokenizer, rows, **kw):
    kw.setdefault("val_size", 0)
    dm = SFTDataModule(tokenizer=tokenizer, dataset=Dataset.from_dict(rows), **kw)
    dm.setup("fit")
    return dm


def test_prompt_completion_labels_mask_prompt_and_padding(tokenizer):
    dm = _dm(tokenizer, {"prompt": ["12+30=", "9+9="], "completion": ["42", "18"]}, sampling="sequential")
    batch = next(iter(dm.train_dataloader()))
    # ByT5: a byte b has id b + 3, EOS is 1, pad is 0. Row 0 = "12+30=42</s>", row 1 = "9+9=18</s>" + 2 pads.
    row0 = [ord(c) + 3 for c in "12+30=42"] + [1]
    assert batch["input_ids"][0].tolist() == row0
    assert batch["labels"][0].tolist() == [-100] * 6 + [ord("4") + 3, ord("2") + 3, 1]
    assert batch["labels"][1].tolist() == [-100] * 4 + [ord("1") + 3, ord("8") + 3, 1, -100, -100]
    assert batch["attention_mask"][1].tolist() == [1] * 7 + [0, 0]
    # target tokens after the causal shift: 3 + 3
    assert int(batch[NUM_ITEMS_KEY]) == 6
    assert dm.train_dataset["length"] == [9, 7]


def test_text_rows_train_on_every_token(tokenizer):
    dm = _dm(tokenizer, {"text": ["hello", "hi"]}, sampling="sequential")
    batch = next(iter(dm.train_dataloader()))
    assert batch["labels"][0].tolist() == [ord(c) + 3 for c in "hello"] + [1]
    assert int(batch[NUM_ITEMS_KEY]) == 5 + 2  # (6 - 1) + (3 - 1) shifted targets


def test_truncation_is_counted_and_prompt_only_rows_dropped(tokenizer):
    with pytest.warns(UserWarning, match="1 rows longer than max_length=6 were truncated; 1 rows had no completion"):
        dm = _dm(tokenizer, {"prompt": ["1+1=", "123456+1="], "completion": ["2", "123457"]}, max_length=6)
    assert len(dm.train_dataset) == 1
    assert dm.stats["train_rows_truncated"] == 1  # the dropped row was the long one
    assert dm.stats["train_rows_dropped_without_target"] == 1
    dm2 = _dm(tokenizer, {"text": ["abcdefghij"]}, max_length=4)
    assert dm2.train_dataset["input_ids"][0] == [ord(c) + 3 for c in "abcd"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_length": 0}, r"`max_length=0` is invalid"),
        ({"batch_size": 0}, r"`batch_size=0` is invalid"),
        ({"prefetch_factor": 2}, r"`prefetch_factor=2` can only be set when data is loaded in worker processes"),
        ({"persistent_workers": True}, r"`persistent_workers=True` needs worker processes"),
        ({"num_workers": -1}, r"`num_workers=-1` is invalid"),
        ({"sampling": "shuffled"}, r"`sampling='shuffled'` is invalid"),
    ],
)
def test_invalid_options_name_the_field(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SFTDataModule(tokenizer=tokenizer, **kwargs)


def test_missing_columns_and_empty_data(tokenizer):
    with pytest.raises(
        ValueError,
        match=r"no 'text' column, no 'messages' column and no 'prompt' \+ 'completion' columns \(it has 'body'\)",
    ):
        _dm(tokenizer, {"body": ["x"]})
    with pytest.raises(ValueError, match="empty"):
        _dm(tokenizer, {"text": []})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _dm_path(tokenizer, "./missing/train.jsonl")
    with pytest.raises(ValueError, match="Unknown built-in dataset"):
        _dm_path(tokenizer, "builtin:multiplication")


def _dm_path(tokenizer, path, **kw):
    dm = SFTDataModule(tokenizer=tokenizer, dataset=path, val_size=0, **kw)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("ext", ["json", "jsonl", "csv", "parquet", "txt"])
def test_local_files(tokenizer, tmp_path, ext):
    rows = [{"text": f"row {i}"} for i in range(5)]
    path = tmp_path / f"data.{ext}"
    if ext == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif ext == "json":
        path.write_text(json.dumps(rows))
    elif ext == "csv":
        path.write_text("text\n" + "\n".join(r["text"] for r in rows))
    elif ext == "txt":
        path.write_text("\n".join(r["text"] for r in rows))
    else:
        Dataset.from_list(rows).to_parquet(str(path))
    dm = _dm_path(tokenizer, str(path))
    assert sorted(bytes(t - 3 for t in ids[:-1]).decode() for ids in dm.train_dataset["input_ids"]) == [
        f"row {i}" for i in range(5)
    ]


def test_directory_with_validation_file(tokenizer, tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"text": f"t{i}"}) for i in range(6)))
    (tmp_path / "validation.jsonl").write_text(json.dumps({"text": "v0"}))
    dm = _dm_path(tokenizer, str(tmp_path))
    assert len(dm.train_dataset) == 6 and len(dm.val_dataset) == 1


@pytest.mark.slow
def test_builtin_split_is_held_out(tokenizer):
    dm = SFTDataModule(tokenizer=tokenizer, max_length=32)
    dm.setup("fit")
    train = set(map(tuple, dm.train_dataset["input_ids"]))
    val = set(map(tuple, dm.val_dataset["input_ids"]))
    assert len(train) == 7600 and len(val) == 500 and not train & val


def test_val_size_split(tokenizer):
    dm = _dm(tokenizer, {"text": [f"r{i}" for i in range(20)]}, val_size=0.25)
    assert len(dm.train_dataset) == 15 and len(dm.val_dataset) == 5


def test_train_loader_resumes_mid_epoch_exactly():
    rows = [{"x": i} for i in range(11)]
    collate = lambda b: {"x": torch.tensor([r["x"] for r in b])}

    def make():
        return TrainLoader(
            rows,
            ShardedBatchSampler(11, 2, seed=5),
            collate,
            count_items=lambda b: len(b["x"]),
            accumulate_grad_batches=2,
        )

    full = make()
    full.set_epoch(3)
    expected = [b["x"].tolist() for b in full]
    assert sorted(i for batch in expected for i in batch) == list(range(11))
    partial = make()
    partial.set_epoch(3)
    it = iter(partial)
    got = [next(it)["x"].tolist() for _ in range(2)]
    state = partial.state_dict()
    assert state == {"epoch": 3, "position": 2}
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    got += [b["x"].tolist() for b in resumed]
    assert got == expected
    # a resume position only applies to its own epoch
    other = make()
    other.load_state_dict(state)
    other.set_epoch(4)
    assert len(list(other)) == 6


def test_window_counts_and_rank_sharding():
    rows = [{"x": i} for i in range(10)]
    collate = lambda b: {"x": torch.tensor([r["x"] for r in b])}
    per_rank = []
    for rank in (0, 1):
        loader = TrainLoader(
            rows,
            ShardedBatchSampler(10, 2, seed=0, num_replicas=2, rank=rank),
            collate,
            count_items=lambda b: len(b["x"]),
            accumulate_grad_batches=2,
        )
        batches = list(loader)
        per_rank.append(batches)
        # windows of 2 micro-batches; the last window holds 1 micro-batch (3 batches per rank)
        assert [int(b["num_items_in_batch"]) for b in batches] == [4, 4, 2]
    flat = [i for batches in per_rank for b in batches for i in b["x"].tolist()]
    # 5 global batches dealt to 2 ranks: the 6th slot re-uses the first 2 indices of the epoch
    assert len(flat) == 12 and set(flat) == set(range(10))


def test_hub_dataset_names_go_to_load_dataset(tokenizer, monkeypatch):
    from datasets import DatasetDict

    import lit_trainer.data.sources as sources

    calls = []

    def fake_load_dataset(name, *args, **kwargs):
        calls.append(name)
        return DatasetDict(
            {"train": Dataset.from_dict({"text": ["a", "b", "c"]}), "test": Dataset.from_dict({"text": ["d"]})}
        )

    monkeypatch.setattr(sources, "load_dataset", fake_load_dataset)
    dm = _dm_path(tokenizer, "someorg/some-dataset")
    assert calls == ["someorg/some-dataset"]
    assert len(dm.train_dataset) == 3 and len(dm.val_dataset) == 1  # the hub's "test" split validates


# ------------------------------------------------------------------------------------- nothing to learn
EMPTY_CASES = {
    "prompt/completion": (
        {"prompt": ["1+1=", "2+2="], "completion": ["", ""]},
        {},
        r"All 2 train rows have an empty 'completion'",
    ),
    "text": ({"text": ["", ""]}, {}, r"All 2 train rows have an empty 'text'"),
    "messages": (
        {"messages": [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "2+2="}]]},
        {"assistant_only_loss": True},
        r"no assistant message.*assistant_only_loss=True.*assistant_only_loss=False",
    ),
}


@pytest.mark.parametrize(
    ("case", "tokenizer_kind"),
    [(case, "preset") for case in EMPTY_CASES] + [(case, "byt5") for case in EMPTY_CASES if case != "messages"],
)  # ByT5 has no chat template
def test_rows_with_nothing_to_learn_are_refused_naming_the_column(tokenizer, case, tokenizer_kind):
    from lit_trainer.models import build_tokenizer

    rows, kwargs, message = EMPTY_CASES[case]
    tok = build_tokenizer() if tokenizer_kind == "preset" else tokenizer  # ByT5 ends every encoding with EOS itself
    with pytest.raises(ValueError, match=rf"(?s){message}") as raised:
        _dm(tok, rows, **kwargs)
    assert "nothing to learn" in str(raised.value) and "max_length" not in str(raised.value)  # not a length problem


def test_some_empty_completions_are_counted_and_warned():
    from lit_trainer.models import build_tokenizer

    rows = {"prompt": ["1+1=", "2+2=", "3+3="], "completion": ["2", "", ""]}
    with pytest.warns(UserWarning, match=r"2 of 3 train rows have an empty 'completion'"):
        dm = _dm(build_tokenizer(), rows)
    assert dm.stats["train_rows_empty_completion"] == 2
    assert len(dm.train_dataset) == 3  # kept: each still teaches to stop after its prompt (EOS), as TRL trains them
