"""What ``datasets`` pickles to fingerprint the data modules' ``map``/``filter`` calls (issue 48).

``Dataset.map`` hashes its function and ``fn_kwargs`` (a dill pickle) for the cache fingerprint. A function that
closes over the data module pickles the module, whose ``trainer`` points at the model during ``fit``: megabytes per
call (1.1 GiB of peak memory on a 145M model). Each case fits through a ``Trainer`` with a model of a few MB and
records the size of every function and ``fn_kwargs`` pickled while fitting; the fingerprints must also be the same in
two fresh processes, so that ``datasets``' cache of a file's tokenized rows is reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets.arrow_dataset
import datasets.fingerprint
import pytest
from data_fingerprints import CASES, data_module, fit_case, rows  # tests/scripts
from datasets.utils._dill import dumps

# the tokenizer (or processor) is pickled with the function's options: 23-26 kB; the models weigh 4-10 MiB
LIMIT = 64 * 1024
MAPPING = {"function", "fn_kwargs"}  # the arguments of map/filter that hold the user's code and its options
SCRIPT = Path(__file__).parent / "scripts" / "data_fingerprints.py"


@pytest.fixture
def pickled(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """``(transform, argument, pickled bytes)`` of every function and ``fn_kwargs`` ``datasets`` fingerprints."""
    seen: list[tuple[str, str, int]] = []
    plain = datasets.fingerprint.update_fingerprint

    def recording(fingerprint: str, transform: Any, transform_args: dict[str, Any]) -> str:
        for key in MAPPING.intersection(transform_args):
            if transform_args[key] is not None:
                seen.append((str(transform), key, len(dumps(transform_args[key]))))
        return plain(fingerprint, transform, transform_args)

    # map calls the name it imported; filter and the other transforms go through fingerprint.py's decorator
    monkeypatch.setattr(datasets.arrow_dataset, "update_fingerprint", recording)
    monkeypatch.setattr(datasets.fingerprint, "update_fingerprint", recording)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fit_pickles_kilobytes_per_mapped_function_whatever_the_model(case: str, pickled: list) -> None:
    dm = data_module(case, rows(case))
    lit = fit_case(case, dm)
    model_bytes = sum(p.numel() * p.element_size() for p in lit.parameters())
    assert model_bytes > 20 * LIMIT  # a model whose pickle would show
    assert lit.trainer.global_step == 2 and dm.trainer is lit.trainer  # tokenized inside fit, the trainer attached
    too_big = [entry for entry in pickled if entry[2] > LIMIT]
    assert not too_big, f"pickled for the fingerprint (bytes): {too_big}; the model holds {model_bytes} bytes"
    if case not in ("vision_sft", "vision_prompt"):  # those measure their rows in a loop, without map
        assert any(key == "function" for _, key, _ in pickled), "no mapped function was recorded"


@pytest.mark.slow
def test_fingerprints_are_the_same_in_two_fresh_processes(tmp_path: Path) -> None:
    root = Path(__file__).parent
    path = os.pathsep.join([str(root.parent), str(root), str(root / "scripts"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    runs = []
    for attempt in range(2):
        out = tmp_path / f"fingerprints{attempt}.json"
        done = subprocess.run(
            [sys.executable, str(SCRIPT), str(tmp_path / "data"), str(out)],
            capture_output=True, text=True, env=env, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        runs.append(json.loads(out.read_text()))
    first, second = runs
    assert set(first) == {*CASES, "sft_max_length_24"}
    assert first == second
    for case in CASES:
        assert all(first[case]), case  # both splits fingerprinted
    # the options reach the fingerprint: another max_length tokenizes again
    assert first["sft_max_length_24"][0] != first["sft"][0]
