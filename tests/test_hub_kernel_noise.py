"""bitsandbytes (the ``qlora`` extra) tries, when imported on a CPU with AVX512-BF16, to fetch an optional kernel from
the Hugging Face hub and logs "Failed to load ... from kernels-community" when it cannot (offline, untrusted). Every
``lit-trainer`` run imports it, so plain SFT printed it too: the CLI drops it, and a run that quantizes is told once,
in lit_trainer's words, that it is harmless. The CPU feature is faked (``helpers/avx512bf16``), the hub is offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import QUIET_FIT
from helpers.ddp import output_tail, run_lit_trainer

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAKE_CPU = Path(__file__).resolve().parent / "helpers" / "avx512bf16"
ENV = {"PYTHONPATH": os.pathsep.join([str(FAKE_CPU), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"}
NOTE = "bitsandbytes could not load its optional optimized 4-bit kernel"


def test_the_fake_cpu_makes_bitsandbytes_warn():
    # what the CLI filters is there: without lit_trainer, importing bitsandbytes logs the failure
    env = {**os.environ, **ENV}
    imported = subprocess.run(
        [sys.executable, "-c", "import bitsandbytes"], env=env, capture_output=True, text=True, timeout=300
    )
    assert "kernels-community" in imported.stderr, output_tail(imported)


@pytest.mark.slow
def test_a_plain_sft_run_prints_no_hub_kernel_failure(tmp_path):
    fit = run_lit_trainer(
        "fit", "--config", CONFIGS / "sft.yaml", "--trainer.max_steps", "1", *QUIET_FIT, cwd=tmp_path, **ENV
    )
    assert fit.returncode == 0, output_tail(fit)
    output = fit.stdout + fit.stderr
    assert "kernels-community" not in output and "Failed to load" not in output
    assert NOTE not in output


@pytest.mark.slow
def test_a_quantized_run_says_once_what_it_means(tmp_path):
    args = ["--model.init_args.model", "tiny", "--trainer.max_steps", "1", *QUIET_FIT]
    fit = run_lit_trainer("fit", "--config", CONFIGS / "sft_qlora.yaml", *args, cwd=tmp_path, **ENV)
    assert fit.returncode == 0, output_tail(fit)
    output = fit.stdout + fit.stderr
    assert "Failed to load" not in output
    assert output.count(NOTE) == 1
