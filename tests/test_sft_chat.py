"""SFT on conversations: messages rows, conversational prompt/completion, assistant_only_loss, malformed rows, the
presets' chat template and its export.

The presets' tokenizer is byte-level (byte b -> id b + 3, "</s>" -> 1), so a token position is a character position
of the rendered text, with "</s>" one position: the expected positions below are counted by hand on the text.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoTokenizer

from helpers.rounding import Rounding, relative_l2
from lit_trainer.callbacks.hf_export import export_hf
from lit_trainer.data import SFTDataModule
from lit_trainer.data.chat import assistant_tokens, render
from lit_trainer.losses.logprobs import IGNORE_INDEX
from lit_trainer.models import CHAT_TEMPLATE, build_preset_model, build_tokenizer

SYSTEM, USER1, ANSWER1 = (
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "1+2=?"},
    {"role": "assistant", "content": "3"},
)
USER2, ANSWER2 = {"role": "user", "content": "4+5=?"}, {"role": "assistant", "content": "9"}
TWO_TURNS = [SYSTEM, USER1, ANSWER1, USER2, ANSWER2]
# "<|system|>\nAdd.\n" = 0..15, "<|user|>\n1+2=?\n" = 16..30, "<|assistant|>\n" = 31..44, "3" = 45, "</s>" = 46,
# "<|user|>\n4+5=?\n" = 47..61, "<|assistant|>\n" = 62..75, "9" = 76, "</s>" = 77
TWO_TURNS_TEXT = "<|system|>\nAdd.\n<|user|>\n1+2=?\n<|assistant|>\n3</s><|user|>\n4+5=?\n<|assistant|>\n9</s>"
ASSISTANT_POSITIONS = [45, 46, 76, 77]
NO_MARKERS = re.sub(r"\{% (end)?generation %\}", "", CHAT_TEMPLATE)


def setup_dm(rows: dict | Dataset, tokenizer=None, **kwargs) -> SFTDataModule:
    data = rows if isinstance(rows, Dataset) else Dataset.from_dict(rows)
    dm = SFTDataModule(
        tokenizer=tokenizer or build_tokenizer(),
        dataset=data,
        val_size=0,
        batch_size=kwargs.pop("batch_size", 2),
        max_length=kwargs.pop("max_length", 128),
        **kwargs,
    )
    dm.setup("fit")
    return dm


def target_positions(dm: SFTDataModule, index: int = 0) -> list[int]:
    labels = dm._collate([dm.train_dataset[index]], train=True)["labels"][0]
    return [i for i, label in enumerate(labels.tolist()) if label != IGNORE_INDEX]


def test_presets_template_renders_the_hand_checked_text():
    assert build_tokenizer().apply_chat_template(TWO_TURNS, tokenize=False) == TWO_TURNS_TEXT


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, NO_MARKERS], ids=["generation_markers", "turn_prefixes"])
def test_assistant_mask_of_a_multi_turn_conversation(template):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    ids, mask = assistant_tokens(tokenizer, TWO_TURNS, {})
    assert ids == render(tokenizer, TWO_TURNS) and len(ids) == 78
    assert [i for i, m in enumerate(mask) if m] == ASSISTANT_POSITIONS
    dm = setup_dm({"messages": [TWO_TURNS]}, tokenizer, assistant_only_loss=True)
    assert target_positions(dm) == ASSISTANT_POSITIONS


def test_messages_rows_train_on_every_token_and_prompt_ends_before_the_last_answer():
    dm = setup_dm({"messages": [TWO_TURNS]})
    assert target_positions(dm) == list(range(78))
    assert dm.train_dataset[0]["prompt_length"] == 76  # the exact-match prompt: everything before "9</s>"
    batch = dm._collate([dm.train_dataset[0]], train=False)
    prompt_text = TWO_TURNS_TEXT[: TWO_TURNS_TEXT.rindex("9")]
    assert batch["prompt_input_ids"][0].tolist() == build_tokenizer()(prompt_text)["input_ids"]
    assert batch["completion_ids"][0].tolist() == [ord("9") + 3, 1]


def test_conversational_prompt_completion_trains_on_the_completion():
    dm = setup_dm({"prompt": [[SYSTEM, USER1]], "completion": [[ANSWER1]]})
    assert target_positions(dm) == [45, 46]
    assert dm.train_dataset[0]["prompt_length"] == 45
    # a completion of several turns: assistant_only_loss also masks the user turn inside it
    dm = setup_dm({"prompt": [[SYSTEM, USER1]], "completion": [[ANSWER1, USER2, ANSWER2]]}, assistant_only_loss=True)
    assert target_positions(dm) == ASSISTANT_POSITIONS


def test_tools_and_chat_template_kwargs_columns_reach_the_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{{ note if note is defined else '' }}" + CHAT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "add"}}]
    dm = setup_dm(
        {"messages": [[USER1, ANSWER1]], "tools": [json.dumps(tools)], "chat_template_kwargs": [{"note": "N:"}]},
        tokenizer,
    )
    text = tokenizer.decode(dm.train_dataset[0]["input_ids"])
    assert text == (
        'N:<|tools|>\n[{"type": "function", "function": {"name": "add"}}]\n<|user|>\n1+2=?\n<|assistant|>\n3</s>'
    )


def test_assistant_only_loss_refuses_a_template_without_markers_whose_turns_are_not_prefixes():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{{ messages | length }}" + NO_MARKERS  # the turn count changes every earlier token
    with pytest.raises(ValueError, match=r"cannot find the assistant tokens.*\{% generation %\}"):
        setup_dm({"messages": [TWO_TURNS]}, tokenizer, assistant_only_loss=True)
    setup_dm({"messages": [TWO_TURNS]}, tokenizer)  # without assistant_only_loss the rows are fine


def test_assistant_only_loss_refuses_string_rows_and_conversations_need_a_template():
    with pytest.raises(ValueError, match=r"assistant_only_loss=True` needs conversations"):
        setup_dm({"text": ["1+2=3"]}, assistant_only_loss=True)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        setup_dm({"messages": [TWO_TURNS]}, tokenizer)


MALFORMED = {
    "missing role": ([{"content": "hi"}], r"message 0 has no 'role'"),
    "unknown role": ([{"role": "robot", "content": "hi"}], r"message 0 has an unknown role 'robot'"),
    "empty content": ([USER1, {"role": "assistant", "content": ""}], r"message 1 \(assistant\) has empty content"),
    "empty list": ([], r"the message list is empty"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_conversation_names_its_row(case):
    bad, problem = MALFORMED[case]
    rows = [[USER1, ANSWER1], bad, [USER1, ANSWER1]]
    with pytest.raises(ValueError, match=rf"row 1 of the train data, column 'messages': {problem}"):
        setup_dm(Dataset.from_list([{"messages": r} for r in rows]))


def test_non_list_conversation_names_its_row():
    with pytest.raises(ValueError, match=r"row 0 of the train data, column 'messages': expected a list of .*str"):
        setup_dm({"messages": ["hello", "there"]})


IN_A_FILE = {**MALFORMED, "not a list": ("hello", r"expected a list of .*messages, got str 'hello'")}


@pytest.mark.parametrize("case", IN_A_FILE, ids=list(IN_A_FILE))
def test_malformed_conversation_in_a_file_names_file_and_line(case, tmp_path):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [USER1, ANSWER1]}
    bad, problem = IN_A_FILE[case]
    path.write_text("\n".join(json.dumps(row) for row in [good, good, {"messages": bad}, good]) + "\n")
    with pytest.raises(ValueError, match=rf"line 3 of {re.escape(str(path))}, column 'messages': {problem}"):
        SFTDataModule(dataset=str(path), val_size=0).setup("fit")


def test_exported_tokenizer_keeps_the_chat_template(tmp_path):
    tokenizer = build_tokenizer()
    export_hf(build_preset_model("tiny-64"), tokenizer, tmp_path / "export")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert reloaded.chat_template == CHAT_TEMPLATE
    assert reloaded.apply_chat_template(TWO_TURNS, tokenize=False) == TWO_TURNS_TEXT
    prompt = reloaded.apply_chat_template([SYSTEM, USER1], add_generation_prompt=True, tokenize=False)
    assert prompt == TWO_TURNS_TEXT[:45]


CHATS = [TWO_TURNS, [USER1, ANSWER1], [SYSTEM, USER2, ANSWER2], [USER2, ANSWER2, USER1, ANSWER1]]


def kept_losses(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses of the batch's targets (after the causal shift) and those targets' token ids."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"][:, 1:]
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
    return ce[labels != IGNORE_INDEX], labels[labels != IGNORE_INDEX]


@pytest.mark.parametrize("packing", ["padding_free", "bfd"])
def test_packed_chat_rows_keep_the_assistant_only_loss(packing) -> None:
    """Packed conversations train on exactly the assistant tokens of the padded batch, with the same losses."""
    rows = {"messages": CHATS}
    padded = setup_dm(rows, assistant_only_loss=True, batch_size=4)
    packed = setup_dm(rows, assistant_only_loss=True, batch_size=4, packing=packing)
    model = build_tiny_chat_model()
    a = padded._collate(list(padded.train_dataset), train=True)
    b = packed._collate(list(packed.train_dataset), train=True)
    assert "attention_mask" not in b and int(b["position_ids"].eq(0).sum()) >= len(CHATS)
    loss_a, target_a = kept_losses(model, a)
    loss_b, target_b = kept_losses(model, b)
    # tolerance: the padded losses' float32 rounding against the same model in float64 (helpers/rounding.py); a real
    # mistake: packed rows attending to each other (the packed batch without its position ids)
    rounding = Rounding.of({"loss": loss_a}, {"loss": kept_losses(copy.deepcopy(model).double(), a)[0]}, what="loss")
    leaked = kept_losses(model, {k: v for k, v in b.items() if k != "position_ids"})[0]
    assert int(packed.count_items(b)) == int(padded.count_items(a)) == target_a.numel() == 4 + 2 + 2 + 4
    if packing == "padding_free":  # same row order: token by token; the first row's targets are hand-checked
        first = [i for i, label in enumerate(b["labels"][0].tolist()) if label != IGNORE_INDEX][:4]
        assert first == ASSISTANT_POSITIONS
        assert torch.equal(target_b, target_a)
        rounding.check({"loss": loss_b}, {"loss": loss_a}, mistake=relative_l2({"loss": leaked}, {"loss": loss_a}))
    else:  # bins reorder the rows: the same multiset of (target, loss)
        assert len(packed.train_dataset) < len(CHATS) and "loss_mask" in packed.train_dataset.column_names
        assert sorted(target_b.tolist()) == sorted(target_a.tolist())
        a_sorted, leaked_sorted = {"loss": loss_a.sort().values}, {"loss": leaked.sort().values}
        rounding.check({"loss": loss_b.sort().values}, a_sorted, mistake=relative_l2(leaked_sorted, a_sorted))


def build_tiny_chat_model():
    torch.manual_seed(0)
    return build_preset_model("tiny").eval()
