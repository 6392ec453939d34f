"""The presets' tokenizer behaves like a causal-LM tokenizer (no EOS appended to a prompt) with ByT5's ids.

Before, the presets used ``ByT5Tokenizer``, which appends ``</s>`` (id 1) to every encoding, so
``model.generate(**tokenizer("12+34=", return_tensors="pt"))`` asked the model to continue after an EOS. The data
modules must produce the same token ids as before: ByT5 is the "before" reference here.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer

from helpers.readme import run_readme_generate
from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule
from lit_trainer.models import load_model, load_tokenizer


def ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    pick = [lambda: rnd.randint(32, 126), lambda: rnd.randint(0, 0x2FFF), lambda: rnd.randint(0x1F300, 0x1F6FF)]
    return ["".join(chr(rnd.choice(pick)()) for _ in range(rnd.randint(0, 24))) for _ in range(n)]


def test_preset_tokenizer_has_byt5_ids_without_the_appended_eos():
    tok = load_tokenizer("tiny")
    assert tok("12+34=")["input_ids"] == [52, 53, 46, 54, 55, 64]  # byte + 3, nothing appended
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, len(tok)) == (0, 1, 2, 384)
    assert tok("82</s>")["input_ids"] == [59, 53, 1]  # the EOS string is the EOS token
    byt5 = ByT5Tokenizer()
    for text in ["", " a  b ", "é€😀", "tab\tnew\nline", *_random_texts(200)]:
        encoded = tok(text)["input_ids"]
        assert encoded + [1] == byt5(text)["input_ids"], text
        assert encoded == ids(text)
        assert tok.decode(encoded) == text
    assert tok.decode([52, 53, 1, 0], skip_special_tokens=True) == "12"


def test_saved_tokenizer_reloads_with_auto_tokenizer_without_remote_code(tmp_path):
    torch.manual_seed(0)
    load_model("tiny-64").save_pretrained(tmp_path)
    load_tokenizer("tiny-64").save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    for again in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(str(tmp_path))):
        assert type(again).__name__ != "ByT5Tokenizer"
        assert again("12+34=")["input_ids"] == [52, 53, 46, 54, 55, 64]
        assert again("a </s>é")["input_ids"] == ids("a ") + [1] + ids("é")
        assert (again.pad_token_id, again.eos_token_id, len(again)) == (0, 1, 384)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (1, 0)


@pytest.mark.slow
def test_builtin_sft_rows_are_the_same_token_ids_as_with_byt5():
    new, old = (SFTDataModule(tokenizer=t, max_length=32) for t in (load_tokenizer("tiny"), ByT5Tokenizer()))
    for dm in (new, old):
        dm.setup("fit")
    for split in ("train_dataset", "val_dataset"):
        for column in ("input_ids", "prompt_length", "length"):
            assert getattr(new, split)[column] == getattr(old, split)[column], (split, column)
    first = new.train_dataset[0]
    prompt = first["input_ids"][: first["prompt_length"]]
    assert first["input_ids"][-1] == 1 and 1 not in prompt  # "a+b=" then the sum then EOS, added by SFTDataModule


@pytest.mark.slow
def test_builtin_preference_rows_are_the_same_token_ids_as_with_byt5():
    new, old = (PreferenceDataModule(tokenizer=t, max_length=32) for t in (load_tokenizer("tiny"), ByT5Tokenizer()))
    for dm in (new, old):
        dm.setup("fit")
    for column in ("prompt_ids", "chosen_ids", "rejected_ids", "length"):
        assert new.train_dataset[column] == old.train_dataset[column], column
    first = new.train_dataset[0]
    assert first["chosen_ids"][-1] == 1 and first["rejected_ids"][-1] == 1 and 1 not in first["prompt_ids"]


@pytest.mark.slow
def test_grpo_prompts_have_no_trailing_eos_and_match_byt5():
    new, old = (PromptDataModule(tokenizer=t, max_length=16) for t in (load_tokenizer("tiny"), ByT5Tokenizer()))
    for dm in (new, old):
        dm.setup("fit")
    assert new.train_dataset["prompt_input_ids"] == old.train_dataset["prompt_input_ids"]
    row = new.train_dataset[0]
    assert row["prompt_input_ids"] == ids(row["prompt"])  # "a+b=" bytes, no EOS at the end


@pytest.mark.parametrize("prompt", ["12+34=", "50+49="])
def test_readme_generate_example_runs_on_an_export(tmp_path, prompt):
    """The README's lines run as written on an (untrained) export: the prompt is continued, not ended by EOS."""
    torch.manual_seed(0)
    load_model("tiny-64").save_pretrained(tmp_path)
    load_tokenizer("tiny-64").save_pretrained(tmp_path)
    printed = run_readme_generate(str(tmp_path), prompt)
    assert printed.startswith(prompt)
