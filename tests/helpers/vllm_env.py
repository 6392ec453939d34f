"""Where the tests find vLLM: an environment of its own (vLLM pins an older transformers than the project's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lit_trainer.generation.vllm import PYTHON_ENV

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    """``$LIT_TRAINER_VLLM_PYTHON``, else the repository's ``.venv-vllm`` (what the README's test command creates).

    A missing environment FAILS the test (never skips it): the vLLM tests are part of the suite.
    """
    chosen = os.environ.get(PYTHON_ENV) or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(chosen).exists():
        pytest.fail(
            f"no vLLM environment at {chosen}: create it with `python -m lit_trainer.generation.vllm install "
            f".venv-vllm` (the README's test command does), or set ${PYTHON_ENV}.",
            pytrace=False,
        )
    return chosen
