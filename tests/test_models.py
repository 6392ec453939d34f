import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_trainer.models import PRESETS, build_preset_model, load_model, load_tokenizer


def test_presets_build_with_expected_sizes():
    torch.manual_seed(0)
    model = load_model("tiny")
    n_params = sum(p.numel() for p in model.parameters())
    # hidden 128: embeddings 384*128 = 49,152 (tied) + 2 layers * (4*128*128 attn + 3*128*512 mlp + 2*128 norms)
    # = 2 * (65,536 + 196,608 + 256) = 524,800, + final norm 128 -> 574,080
    assert n_params == 574_080
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 128
    assert sorted(PRESETS) == ["tiny", "tiny-256", "tiny-64"]


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown model preset 'tiny-9'.*'tiny', 'tiny-256', 'tiny-64'"):
        load_model("tiny-9")
    with pytest.raises(ValueError, match="Unknown model preset"):
        build_preset_model("nope")


def test_missing_local_path_and_file_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "missing_model"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("./no/such/dir")
    file = tmp_path / "weights.bin"
    file.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        load_model(str(file))


def test_local_directory_round_trip(tmp_path):
    torch.manual_seed(0)
    model, tok = load_model("tiny-64"), load_tokenizer("tiny-64")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = load_model(str(tmp_path)), load_tokenizer(str(tmp_path))
    assert tok2("37+45=")["input_ids"] == [54, 58, 46, 55, 56, 64]  # bytes + 3, no EOS appended
    ids = torch.tensor([tok("37+45=")["input_ids"]])
    assert tok2("37+45=")["input_ids"] == tok("37+45=")["input_ids"]
    assert torch.equal(model(ids).logits, again(ids).logits)
    # and with the plain transformers Auto classes
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, model(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path)("37+45=")["input_ids"] == tok("37+45=")["input_ids"]


def test_trust_remote_code_defaults_to_false(monkeypatch, tmp_path):
    seen = {}

    def fake_from_pretrained(path, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    with pytest.raises(RuntimeError, match="stop"):
        load_model(str(tmp_path))
    assert seen["trust_remote_code"] is False


def test_sequence_classification_preset_and_from_a_causal_export(tmp_path):
    """A reward model: score head with one label, read at the last non-padding token; from an SFT export the body
    weights are the causal LM's and the head is new."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    scorer = load_model("tiny", task="sequence_classification")
    assert type(scorer).__name__ == "LlamaForSequenceClassification"
    assert scorer.config.num_labels == 1 and scorer.config.pad_token_id == load_tokenizer("tiny").pad_token_id
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    scores = scorer(input_ids=ids).logits
    assert scores.shape == (2, 1)
    # the padded row scores like its unpadded prefix (the head reads position 2, not the padding); 1e-6: another
    # batch shape changes the matmul blocking (float32 rounding, values of order 1), a wrong position differs by >1e-2
    assert torch.allclose(scores[0], scorer(input_ids=ids[:1, :3]).logits[0], atol=1e-6)

    causal = load_model("tiny")
    causal.config.pad_token_id = None  # the tokenizer's padding id must fill it in
    causal.save_pretrained(tmp_path)
    load_tokenizer("tiny").save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), task="sequence_classification")
    assert isinstance(loaded, AutoModelForSequenceClassification._model_mapping[type(loaded.config)])
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == 0
    assert torch.equal(loaded.model.embed_tokens.weight, causal.model.embed_tokens.weight)
    with pytest.raises(ValueError, match=r"Unknown model task 'reward'.*causal_lm"):
        load_model("tiny", task="reward")
