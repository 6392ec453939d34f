"""Fit every data module through a Lightning ``Trainer`` on a model of a few MB, for the fingerprint tests
(``tests/test_data_fingerprint.py``).

``CASES`` names one data module + LightningModule pair per data module and row kind (text SFT, preference, prompt and
unpaired rows; SFT, preference and prompt rows with images on ``tiny-vl``). :func:`fit_case` fits one for 2 steps
(the data module tokenizes inside ``fit``, with ``dm.trainer`` pointing at the model, the condition of issue 48).

Usage: python data_fingerprints.py DATA_DIR OUT_JSON: writes the rows of every case to DATA_DIR as files (when not
there yet), fits every case on them, with ``sft`` again at another ``max_length``, and writes
``{case: [train fingerprint, validation fingerprint]}`` to OUT_JSON. Run twice with the same ``HF_DATASETS_CACHE``,
the fingerprints must be equal (``datasets``' cache is then reused).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from helpers.models import tiny_llama

TEXT_CASES = ("sft", "preference", "prompt", "unpaired")
VISION_CASES = ("vision_sft", "vision_preference", "vision_prompt")
CASES = TEXT_CASES + VISION_CASES
BIG_VOCAB = 16384  # a 4 MiB embedding: pickling the model would add megabytes (the tokenizer's ids stay below 384)


def rows(case: str) -> Any:
    """A few rows of the case's built-in data (in memory)."""
    from lit_trainer.data import builtin, builtin_shapes

    if case in VISION_CASES:
        kind = case.removeprefix("vision_")
        return getattr(builtin_shapes, f"{kind}_rows")("train").select(range(12))
    kind = "preference" if case == "unpaired" else case
    return getattr(builtin, f"{kind}_rows")("train").select(range(48))


def data_module(case: str, dataset: Any, **options: Any) -> Any:
    from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule
    from lit_trainer.data.unpaired import UnpairedPreferenceDataModule
    from lit_trainer.models import build_processor, build_tokenizer

    kinds = {"sft": SFTDataModule, "preference": PreferenceDataModule, "prompt": PromptDataModule}
    kind = UnpairedPreferenceDataModule if case == "unpaired" else kinds[case.removeprefix("vision_")]
    tokenizer = build_processor() if case in VISION_CASES else build_tokenizer()
    settings = {"max_length": 160 if case in VISION_CASES else 32, "batch_size": 4, "val_size": 4, **options}
    return kind(tokenizer=tokenizer, dataset=dataset, **settings)


def module(case: str) -> Any:
    """The case's LightningModule on a model with a 16,384-id embedding: a Llama (4.2 MiB) or ``tiny-vl`` (10 MiB)."""
    from lit_trainer import CausalLMModule, DPOModule, GRPOModule, KTOModule
    from lit_trainer.models import build_processor, build_tokenizer, build_vision_preset

    if case in VISION_CASES:
        torch.manual_seed(0)
        model, tokenizer = build_vision_preset(), build_processor()
        model.resize_token_embeddings(BIG_VOCAB)
    else:
        model, tokenizer = tiny_llama(0, hidden=64, vocab=BIG_VOCAB, eos_bias=0.0), build_tokenizer()
    kind = case.removeprefix("vision_")
    if kind == "prompt":
        rewards = ["lit_trainer.rewards.arithmetic_reward"]
        return GRPOModule(model, tokenizer=tokenizer, reward_funcs=rewards, num_generations=2, max_completion_length=2)
    return {"sft": CausalLMModule, "preference": DPOModule, "unpaired": KTOModule}[kind](model)


def fit_case(case: str, dm: Any) -> Any:
    """Fit ``case``'s module on ``dm`` for 2 optimizer steps on the CPU; returns the LightningModule."""
    lit = module(case)
    trainer = pl.Trainer(
        max_steps=2, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(lit, datamodule=dm)
    return lit


def write_files(folder: Path) -> dict[str, Path]:
    """The rows of every case as a file in ``folder`` (JSON lines for text, parquet for images), written once."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for case in CASES:
        path = folder / (f"{case}.parquet" if case in VISION_CASES else f"{case}.jsonl")
        if not path.exists():
            data = rows(case)
            data.to_parquet(str(path)) if case in VISION_CASES else data.to_json(str(path), lines=True)
        paths[case] = path
    return paths


def main(folder: Path, out: Path) -> None:
    paths = write_files(folder)
    fingerprints: dict[str, list[str | None]] = {}
    runs = [(case, case, {}) for case in CASES] + [("sft_max_length_24", "sft", {"max_length": 24})]
    for name, case, options in runs:
        dm = data_module(case, str(paths[case]), **options)
        fit_case(case, dm)
        fingerprints[name] = [dm.train_dataset._fingerprint, dm.val_dataset._fingerprint]
    out.write_text(json.dumps(fingerprints))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
