"""PreferenceDataModule: row formats, EOS, truncation, dropped and malformed rows, collation (as TRL's).

See docs/design.md#trl-dpo.

ByT5 ids: a byte b has id b + 3, EOS ("</s>") is 1, pad is 0. So "1" -> 52, "+" -> 46, "=" -> 64, "3" -> 54.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from lit_trainer.data import builtin, builtin_shapes
from lit_trainer.data.loader import NUM_ITEMS_KEY
from lit_trainer.data.preference import PreferenceDataModule, extract_prompt

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def make(tokenizer, rows: dict | list, **kw) -> PreferenceDataModule:
    kw.setdefault("val_size", 0)
    kw.setdefault("sampling", "sequential")
    data = Dataset.from_list(rows) if isinstance(rows, list) else Dataset.from_dict(rows)
    dm = PreferenceDataModule(tokenizer=tokenizer, dataset=data, **kw)
    dm.setup("fit")
    return dm


def test_explicit_standard_rows_tokenize_and_collate_to_2b_rows(tokenizer):
    dm = make(
        tokenizer,
        {"prompt": ["1+2=", "10+5="], "chosen": ["3", "15"], "rejected": ["4</s>", "16"]},
        batch_size=2,
        max_length=32,
    )
    row = dm.train_dataset[0]
    assert row["prompt_ids"] == [52, 46, 53, 64]  # "1+2=" without the EOS ByT5 appends to the bare prompt
    assert row["chosen_ids"] == [54, 1]  # "3" + EOS appended as a string (reference 1.2 step 2)
    assert row["rejected_ids"] == [55, 1]  # already ends with "</s>": no second EOS
    assert dm.train_dataset["length"] == [6, 8]  # longest of prompt+chosen / prompt+rejected: 4+2, 5+3
    batch = next(iter(dm.train_dataloader()))
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; right-padded to 8 = len("10+5=") + len("15") + EOS
    assert batch["input_ids"].tolist() == [
        ids("1+2=3") + [1, 0, 0],
        ids("10+5=15") + [1],
        ids("1+2=4") + [1, 0, 0],
        ids("10+5=16") + [1],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0, 0], [1] * 8, [1] * 6 + [0, 0], [1] * 8]
    assert batch["completion_mask"].tolist() == [
        [0] * 4 + [1, 1, 0, 0],
        [0] * 5 + [1] * 3,
        [0] * 4 + [1, 1, 0, 0],
        [0] * 5 + [1] * 3,
    ]
    # PAIRS (not rows), the chosen completion tokens after the causal shift (the "sft" term's count): 2 + 3, and the
    # chosen rows' predicted positions, prompt included (ORPO's NLL count): 6 - 1 + 8 - 1
    assert batch[NUM_ITEMS_KEY].tolist() == [2, 5, 12] and dm.count_items(batch).tolist() == [2, 5, 12]
    assert "ref_chosen_logps" not in batch


def test_implicit_prompt_is_the_common_prefix_and_the_space_goes_to_the_completion(tokenizer):
    dm = make(tokenizer, {"chosen": ["The sky is blue"], "rejected": ["The sky is green"]}, max_length=64)
    row = dm.train_dataset[0]
    assert row["prompt_ids"] == ids("The sky is")
    assert row["chosen_ids"] == ids(" blue") + [1]
    assert row["rejected_ids"] == ids(" green") + [1]


def test_extract_prompt_edge_cases():
    # no mismatch: the loop ends on the last compared element, which stays in the completions (as TRL)
    assert extract_prompt("abc", "abcd") == ("ab", "c", "cd")
    # mismatch at 0 after a trailing space: TRL would read chosen[-1] == " " and split at -1; here the prompt is ""
    assert extract_prompt("a ", "b ") == ("", "a ", "b ")
    # conversations: whole messages
    user, a, b = (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "A"},
        {"role": "assistant", "content": "B"},
    )
    assert extract_prompt([user, a], [user, b]) == ([user], [a], [b])


def test_conversational_rows_use_the_chat_template(tokenizer):
    tokenizer.chat_template = TEMPLATE
    user = [{"role": "user", "content": "1+2="}]
    explicit = make(
        tokenizer,
        {
            "prompt": [user],
            "chosen": [[{"role": "assistant", "content": "3"}]],
            "rejected": [[{"role": "assistant", "content": "4"}]],
        },
        max_length=64,
    )
    row = explicit.train_dataset[0]
    # prompt rendered with the generation prompt; completions = what follows it, ending with the template's EOS
    assert row["prompt_ids"] == ids("<|user|>1+2=") + [1] + ids("<|assistant|>")
    assert row["chosen_ids"] == ids("3") + [1]
    assert row["rejected_ids"] == ids("4") + [1]
    implicit = make(
        tokenizer,
        {
            "chosen": [user + [{"role": "assistant", "content": "3"}]],
            "rejected": [user + [{"role": "assistant", "content": "4"}]],
        },
        max_length=64,
    )
    assert implicit.train_dataset[0] == row


def test_conversational_rows_without_chat_template_fail_clearly(tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        make(
            tokenizer,
            {
                "prompt": [[{"role": "user", "content": "q"}]],
                "chosen": [[{"role": "assistant", "content": "a"}]],
                "rejected": [[{"role": "assistant", "content": "b"}]],
            },
        )


def test_keep_start_drops_long_prompts_and_truncates_the_rest(tokenizer):
    rows = {"prompt": ["12345678", "1+2=", "123"], "chosen": ["x", "3", "abcdefgh"], "rejected": ["y", "4", "z"]}
    dm = make(tokenizer, rows, max_length=8, batch_size=2)
    # row 0: prompt of 8 tokens >= max_length 8 -> dropped; row 2: 3 + 9 = 12 tokens -> truncated to 8
    assert dm.stats["train_rows_dropped_prompt_too_long"] == 1
    assert dm.stats["train_rows_truncated"] == 1
    assert len(dm.train_dataset) == 2 and dm.train_dataset["length"] == [6, 8]
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"][1].tolist() == ids("123abcde")  # first 8 tokens of "123abcdefgh</s>"
    assert batch["completion_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert batch["input_ids"][3].tolist() == ids("123z") + [1, 0, 0, 0]  # each row is cut on its own


def test_keep_end_keeps_the_last_tokens_and_drops_nothing(tokenizer):
    rows = {"prompt": ["12345678", "123"], "chosen": ["x", "abcdefgh"], "rejected": ["y", "z"]}
    dm = make(tokenizer, rows, max_length=8, batch_size=2, truncation_mode="keep_end")
    assert dm.stats["train_rows_dropped_prompt_too_long"] == 0
    assert dm.stats["train_rows_truncated"] == 2  # 8+2 and 3+9 tokens
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"][0].tolist() == ids("345678x") + [1]  # last 8 of "12345678x</s>"
    assert batch["completion_mask"][0].tolist() == [0] * 6 + [1, 1]
    assert batch["input_ids"][1].tolist() == ids("bcdefgh") + [1]  # last 8 of "123abcdefgh</s>"
    assert batch["completion_mask"][1].tolist() == [1] * 8
    assert batch["input_ids"][3].tolist() == ids("123z") + [1, 0, 0, 0]


def test_all_rows_dropped_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="No train row is left"):
        make(tokenizer, {"prompt": ["123456789"], "chosen": ["a"], "rejected": ["b"]}, max_length=4)


@pytest.mark.parametrize("rows, column, problem", [
    ({"prompt": ["a", "b", "c"], "chosen": ["x", "y", None], "rejected": ["u", "v", "w"]}, "chosen", "missing"),
    ({"prompt": ["a", "b", "c"], "chosen": ["x", "y", "z"], "rejected": ["u", "v", ""]}, "rejected", "empty"),
    ([{"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": "x"}],
       "rejected": [] if q == "c" else [{"role": "assistant", "content": "u"}]} for q in "abc"], "rejected", "empty"),
])  # fmt: skip
def test_malformed_rows_name_the_row_and_the_column(tokenizer, rows, column, problem):
    tokenizer.chat_template = TEMPLATE
    with pytest.raises(ValueError, match=rf"row 2 of the train data, column '{column}'.*{problem}"):
        make(tokenizer, rows)


def test_non_string_content_is_rejected(tokenizer):
    tokenizer.chat_template = TEMPLATE
    rows = [
        {
            "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
        },
        {
            "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
        },
    ]
    with pytest.raises(ValueError, match=r"row 1 of the train data, column 'rejected'.*non-string content"):
        make(tokenizer, rows)
    with pytest.raises(ValueError, match=r"row 0 of the train data, column 'chosen'.*expected a string"):
        make(tokenizer, {"prompt": ["a"], "chosen": [5], "rejected": [6]})


def test_missing_columns_and_bad_options(tokenizer):
    with pytest.raises(ValueError, match="no 'rejected' column"):
        make(tokenizer, {"prompt": ["a"], "chosen": ["b"]})
    with pytest.raises(ValueError, match="truncation_mode='middle'"):
        PreferenceDataModule(tokenizer=tokenizer, truncation_mode="middle")


def test_reference_logps_travel_with_the_rows_and_the_fingerprint_tracks_content(tokenizer):
    rows = {"prompt": ["1+2=", "2+2=", "3+3="], "chosen": ["3", "4", "6"], "rejected": ["4", "5", "7"]}
    dm = make(tokenizer, rows, batch_size=3)
    first = dm.fingerprint("train")
    dm.set_reference_logps("train", torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0, -5.0, -6.0]), key="k1")
    batch = next(iter(dm.train_dataloader()))
    assert batch["ref_chosen_logps"].tolist() == [-1.0, -2.0, -3.0]
    assert batch["ref_rejected_logps"].tolist() == [-4.0, -5.0, -6.0]
    assert dm.reference_logps_key("train") == "k1" and dm.fingerprint("train") == first
    assert make(tokenizer, rows, batch_size=3).fingerprint("train") == first  # content hash: stable across objects
    changed = dict(rows, rejected=["4", "5", "8"])
    assert make(tokenizer, changed, batch_size=3).fingerprint("train") != first
    assert make(tokenizer, rows, batch_size=3, max_length=5).fingerprint("train") != first
    with pytest.raises(ValueError, match="do not match the 3 rows"):
        dm.set_reference_logps("train", torch.zeros(2), torch.zeros(2), key="bad")


def test_builtin_addition_preferences(tokenizer):
    assert PreferenceDataModule.builtin == {
        "builtin:addition": builtin.preference_rows,
        "builtin:subtraction": builtin.subtraction_preference_rows,
        "builtin:shapes": builtin_shapes.preference_rows,
    }
    raw = builtin.preference_rows("train").select(range(4))
    dm = make(tokenizer, raw.to_dict(), max_length=32)
    for i in range(4):
        row = dm.train_dataset[i]
        assert row["prompt_ids"] == ids(raw[i]["prompt"])
        assert row["chosen_ids"] == ids(raw[i]["chosen"]) + [1]
        assert row["rejected_ids"] == ids(raw[i]["rejected"]) + [1]
        assert row["answer"] == raw[i]["chosen"]


# ------------------------------------------------------------------------------ identical pairs (zero DPO gradient)
def test_identical_pairs_after_tokenization_are_counted_warned_once_and_dropped(tokenizer):
    rows = {
        "prompt": ["1+1=", "2+2=", "3+3=", "4+4="],
        "chosen": ["2", "4</s>", "6", "8"],
        "rejected": ["2", "4", "7", "9"],
    }  # row 0: same text; row 1: the same ids once EOS is appended
    with pytest.warns(UserWarning) as record:
        dm = make(tokenizer, rows, max_length=32, drop_identical_pairs=True)
    messages = [str(w.message) for w in record if "identical" in str(w.message)]
    assert len(messages) == 1, messages
    assert "train: 2 preference rows" in messages[0] and "drop_identical_pairs=False" in messages[0]
    assert dm.stats["train_rows_identical_pairs"] == 2
    assert dm.train_dataset["prompt_ids"] == [ids("3+3="), ids("4+4=")]


def test_identical_pairs_are_kept_by_default_as_trl(tokenizer):
    rows = {"prompt": ["1+1=", "3+3="], "chosen": ["2", "6"], "rejected": ["2", "7"]}
    with pytest.warns(UserWarning, match=r"train: 1 preference rows .* identical .* kept, as TRL"):
        dm = make(tokenizer, rows, max_length=32)
    assert dm.stats["train_rows_identical_pairs"] == 1 and len(dm.train_dataset) == 2


def test_pairs_identical_only_after_truncation_count_too(tokenizer):
    # keep_start, max_length 5: both rows become "1+1=2": the model sees the same inputs, the gradient is zero
    rows = {"prompt": ["1+1=", "1+1="], "chosen": ["2abc", "2"], "rejected": ["2xyz", "3"]}
    dm = make(tokenizer, rows, max_length=5, drop_identical_pairs=True)
    assert dm.stats["train_rows_identical_pairs"] == 1 and dm.train_dataset["chosen_ids"] == [ids("2") + [1]]


def test_only_identical_pairs_is_an_error_naming_the_option(tokenizer):
    with pytest.raises(ValueError, match=r"No train row is left.*1 had chosen == rejected.*drop_identical_pairs"):
        make(tokenizer, {"prompt": ["1+1="], "chosen": ["2"], "rejected": ["2"]}, drop_identical_pairs=True)


@pytest.mark.slow
def test_builtin_addition_has_no_identical_pairs(tokenizer):
    dm = PreferenceDataModule(tokenizer=tokenizer, max_length=32)
    dm.setup("fit")
    assert dm.stats["train_rows_identical_pairs"] == 0 and dm.stats["validation_rows_identical_pairs"] == 0
    assert len(dm.train_dataset) == 7600 and len(dm.val_dataset) == 500
