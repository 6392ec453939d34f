"""Peak resident memory of a real ``trainer.fit`` against the model's bytes: SFT, DPO, GRPO and QLoRA.

One run builds a randomly initialised Llama from a ``LlamaConfig`` (default hidden 512, intermediate 1376, 4 layers,
8 heads, vocab 32,000, head tied to the embeddings: 29M parameters; nothing is downloaded) and fits each variant for
``--steps`` optimizer steps through a Lightning ``Trainer`` (CPU, float32, no validation, no checkpoint, no logger) on
the built-in addition data (``builtin:addition``, tokenized by the presets' byte tokenizer):

  * ``sft``: ``CausalLMModule`` + ``SFTDataModule``;
  * ``dpo``: ``DPOModule`` (a frozen in-memory copy of the policy as reference) + ``PreferenceDataModule``;
  * ``grpo``: ``GRPOModule`` (``arithmetic_reward``, 4 generations of at most 8 tokens) + ``PromptDataModule``;
  * ``qlora``: ``CausalLMModule(quantization="nf4")`` with LoRA r=16 on every linear layer + ``SFTDataModule``, the
    model saved once to a temporary folder and loaded back quantized (needs bitsandbytes; skipped with a note when it
    is not installed).

Each variant runs in its own subprocess: imports done and the data module built, the baseline RSS is read and the
high-water mark reset (``/proc/self/clear_refs``); then the model is built, the module made and ``trainer.fit`` run.
The data module's ``setup`` (reading and tokenizing the rows, inside ``fit``) is timed, and the high-water mark is
reset when it starts, so its own peak above the RSS it started from is measured apart. Columns:

  * model MiB: the parameters and buffers of the LightningModule (the DPO reference copy included; for QLoRA the
    packed 4-bit weights, the adapters and the unquantized embeddings/norms);
  * peak RSS MiB: the highest RSS of the subprocess during model building and ``fit``, above the baseline;
  * peak / model: the two above divided;
  * setup s and setup peak MiB: the data module's ``setup`` inside ``fit`` (wall seconds, and its peak RSS above the
    RSS at its start): what the tokenization costs. Before issue 48's fix, ``datasets`` pickled the whole model there
    for its cache fingerprint (a closure over the data module, whose ``trainer`` points at the model);
  * fit s: the whole ``trainer.fit``.

The subprocesses run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (as ``benchmarks/qlora_memory.py``): glibc returns freed
blocks of 1 MiB or more at once, so the peaks follow the live objects.

Usage: python benchmarks/fit_memory.py [--hidden 512] [--intermediate 1376] [--layers 4] [--heads 8]
                                       [--vocab 32000] [--steps 3] [--threads 2] [--variants sft dpo grpo qlora]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

VARIANTS = ("sft", "dpo", "grpo", "qlora")
LABELS = {
    "sft": "SFT (CausalLMModule)",
    "dpo": "DPO (reference copy)",
    "grpo": "GRPO (4 generations)",
    "qlora": "QLoRA SFT (NF4, LoRA r=16)",
}
MIB = 2**20
MMAP_THRESHOLD = 2**20


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per fit")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--only", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # internal: the saved model (QLoRA)
    return parser.parse_args()


def quiet() -> None:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for name in ("lightning", "lightning.pytorch", "lit_trainer"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def llama(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.generation_config.bos_token_id = None
    return model


def data_module(variant: str) -> Any:
    from lit_trainer.data import PreferenceDataModule, PromptDataModule, SFTDataModule
    from lit_trainer.models import build_tokenizer

    kind = {"dpo": PreferenceDataModule, "grpo": PromptDataModule}.get(variant, SFTDataModule)
    return kind(tokenizer=build_tokenizer(), max_length=32, batch_size=8)


def module(variant: str, args: argparse.Namespace) -> Any:
    from lit_trainer import CausalLMModule, DPOModule, GRPOModule
    from lit_trainer.models import build_tokenizer

    if variant == "qlora":
        lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
        return CausalLMModule(args.folder, quantization="nf4", peft_config=lora, learning_rate=1e-4)
    if variant == "dpo":
        return DPOModule(llama(args), learning_rate=1e-4)
    if variant == "grpo":
        return GRPOModule(
            llama(args), tokenizer=build_tokenizer(), reward_funcs=["lit_trainer.rewards.arithmetic_reward"],
            num_generations=4, max_completion_length=8, learning_rate=1e-4,
        )  # fmt: skip
    return CausalLMModule(llama(args), learning_rate=1e-4)


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; return the high-water mark it had."""
    before = proc_status()["VmHWM"]
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return before


def one_variant(args: argparse.Namespace) -> None:
    """Subprocess mode: build ``args.only``, fit it ``args.steps`` steps, print the measures."""
    import lightning.pytorch as pl

    if args.only == "qlora":
        import bitsandbytes  # noqa: F401  (imported before the baseline: its memory is not the model's)
    import peft  # noqa: F401

    quiet()
    torch.set_num_threads(args.threads)
    dm = data_module(args.only)
    trainer = pl.Trainer(
        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    gc.collect()
    reset_peak()
    base = proc_status()["VmRSS"]
    peaks: list[int] = []
    setup: dict[str, float] = {}
    plain_setup = dm.setup

    def timed_setup(stage: str) -> None:
        peaks.append(reset_peak())
        start_rss, start = proc_status()["VmRSS"], time.perf_counter()
        plain_setup(stage)
        setup["seconds"] += time.perf_counter() - start
        setup["peak"] = max(setup["peak"], proc_status()["VmHWM"] - start_rss)
        peaks.append(reset_peak())

    setup.update(seconds=0.0, peak=0)
    dm.setup = timed_setup
    lit = module(args.only, args)
    start = time.perf_counter()
    trainer.fit(lit, datamodule=dm)
    fit_seconds = time.perf_counter() - start
    model_bytes = sum(t.numel() * t.element_size() for t in (*lit.parameters(), *lit.buffers()))  # ref model made
    peaks.append(proc_status()["VmHWM"])
    print(
        "RESULT "
        + json.dumps(
            {
                "params": sum(p.numel() for p in lit.parameters()),
                "model_bytes": model_bytes,
                "peak_rss": max(peaks) - base,
                "baseline_rss": base,
                "setup_s": setup["seconds"],
                "setup_peak": setup["peak"],
                "fit_s": fit_seconds,
                "steps": trainer.global_step,
            }
        )
    )


def run_variant(args: argparse.Namespace, variant: str, folder: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--only", variant, "--folder", folder]
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    args = parse()
    if args.only:
        one_variant(args)
        return
    quiet()
    variants = [v for v in VARIANTS if v in args.variants]
    notes = []
    if "qlora" in variants and importlib.util.find_spec("bitsandbytes") is None:
        variants.remove("qlora")
        notes.append("QLoRA: skipped, bitsandbytes is not installed (`pip install bitsandbytes`).")
    with tempfile.TemporaryDirectory(prefix="fit_memory_") as folder:
        if "qlora" in variants:
            from lit_trainer.models import build_tokenizer

            llama(args).save_pretrained(folder)
            build_tokenizer().save_pretrained(folder)
        results = {v: run_variant(args, v, folder) for v in variants}
    params = llama(args).num_parameters()
    print(f"command: python benchmarks/{' '.join(sys.argv)}".replace("benchmarks/benchmarks/", "benchmarks/"))
    print(
        f"model: Llama (hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, {args.heads} "
        f"heads, vocab {args.vocab}, tied head), {params / 1e6:.1f}M parameters, float32; {args.steps} optimizer steps "
        f"per fit, batch 8, max_length 32, builtin:addition, {args.threads} thread(s), CPU, "
        f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    )
    print()
    print("| variant | model MiB | peak RSS MiB | peak / model | setup s | setup peak MiB | fit s |")
    print("|---|---|---|---|---|---|---|")
    for v, r in results.items():
        print(
            f"| {LABELS[v]} | {r['model_bytes'] / MIB:.0f} | {r['peak_rss'] / MIB:.0f} | "
            f"x{r['peak_rss'] / r['model_bytes']:.2f} | {r['setup_s']:.2f} | {r['setup_peak'] / MIB:.0f} | "
            f"{r['fit_s']:.1f} |"
        )
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
