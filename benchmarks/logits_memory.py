"""Training peak memory at a real vocabulary: chunked logits vs full logits vs transformers.Trainer / TRL 1.16.

    OMP_NUM_THREADS=2 python benchmarks/logits_memory.py [--algos sft,dpo,grpo] [--vocab 151936] [--seq 512]
        [--batch 4] [--steps 3] [--table]

Every runner trains the same model (a Llama with hidden 64, 2 layers, tied embeddings and the given vocabulary,
the Qwen2 vocabulary size by default; same seed) on the same rows (random letters tokenized by the presets'
byte tokenizer, so every row has the same length) with AdamW (lr 1e-5), batch ``--batch``, for ``--steps``
optimizer steps, each in its own process. Peak memory is the process's resident high-water mark
(``ru_maxrss``) at the end minus its value right before training starts (model, data and libraries loaded): the
memory training itself adds (activations, logits, gradients, optimizer state, for DPO the reference copy). Step time
is the median of the steps after the first.

Runners per algorithm: ``ours`` (default ``chunked_logits="auto"``: chunked at this vocabulary), ``ours-full``
(``chunked_logits="off"``: today's full logits), and the reference: ``hf`` (transformers.Trainer, SFT), ``trl``
(DPOTrainer / GRPOTrainer 1.16; needs ``pip install trl==1.16.0``). GRPO: ``--batch`` prompts x 2 generations,
prompts of ``--seq / 2`` tokens, completions of exactly ``--seq / 2`` new tokens (EOS suppressed), so every runner
scores the same number of tokens.

``--table`` adds ours vs ours-full for SFT at several sequence lengths and vocabularies (the growth of the peak; 2 steps
each).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HIDDEN, LAYERS = 64, 2


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build_model(vocab: int, seq: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=2 * seq + 64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def texts(n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij") for _ in range(length)) for _ in range(n)]


class StepTimer:
    """Wall time of each optimizer step (Lightning callback and transformers callback in one)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now

    def median(self) -> float:
        return statistics.median(self.times[1:] or self.times)


def lightning_trainer(steps: int, timer: StepTimer) -> Any:
    import lightning.pytorch as pl

    class Tick(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            timer.tick()

    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Tick()],
    )


def hf_callback(timer: StepTimer) -> Any:
    from transformers import TrainerCallback

    class Tick(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            timer.tick()

    return Tick()


def hf_args(cls: Any, out: str, args: argparse.Namespace, **extra: Any) -> Any:
    return cls(
        output_dir=out,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-5,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def run_sft(runner: str, args: argparse.Namespace, timer: StepTimer) -> None:
    from datasets import Dataset

    from lit_trainer.data.sft import SFTDataModule
    from lit_trainer.models import build_tokenizer
    from lit_trainer.modules.causal_lm import CausalLMModule

    rows = Dataset.from_dict({"text": texts(args.batch * args.steps, args.seq - 1, 0)})
    model = build_model(args.vocab, args.seq)
    dm = SFTDataModule(
        tokenizer=build_tokenizer(), dataset=rows, batch_size=args.batch, max_length=args.seq, val_size=0
    )
    if runner.startswith("ours"):
        chunked = "off" if runner == "ours-full" else "auto"
        module = CausalLMModule(model, tokenizer=build_tokenizer(), learning_rate=1e-5, chunked_logits=chunked)
        trainer = lightning_trainer(args.steps, timer)
        report["baseline"] = _rss_mib()
        trainer.fit(module, datamodule=dm)
        return
    from transformers import Trainer, TrainingArguments, default_data_collator

    dm.setup("fit")
    ids = dm.train_dataset["input_ids"]  # the rows ours trains on (text + EOS), all of one length
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=model,
            args=hf_args(TrainingArguments, out, args),
            train_dataset=data,
            data_collator=default_data_collator,
            callbacks=[hf_callback(timer)],
        )
        report["baseline"] = _rss_mib()
        trainer.train()


def preference_rows(args: argparse.Namespace) -> Any:
    from datasets import Dataset

    n, half = args.batch * args.steps, args.seq // 2 - 1
    return Dataset.from_dict({"prompt": texts(n, half, 1), "chosen": texts(n, half, 2), "rejected": texts(n, half, 3)})


def run_dpo(runner: str, args: argparse.Namespace, timer: StepTimer) -> None:
    from lit_trainer.data.preference import PreferenceDataModule
    from lit_trainer.models import build_tokenizer
    from lit_trainer.modules.dpo import DPOModule

    rows = preference_rows(args)
    model = build_model(args.vocab, args.seq)
    if runner.startswith("ours"):
        chunked = "off" if runner == "ours-full" else "auto"
        module = DPOModule(model, tokenizer=build_tokenizer(), learning_rate=1e-5, chunked_logits=chunked)
        dm = PreferenceDataModule(
            tokenizer=build_tokenizer(), dataset=rows, batch_size=args.batch, max_length=args.seq + 8, val_size=0
        )
        trainer = lightning_trainer(args.steps, timer)
        report["baseline"] = _rss_mib()
        trainer.fit(module, datamodule=dm)
        return
    import copy

    from trl import DPOConfig, DPOTrainer

    with tempfile.TemporaryDirectory() as out:
        trainer = DPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),  # the same frozen copy ours keeps (the model was built, not loaded)
            args=hf_args(DPOConfig, out, args, max_length=args.seq + 8),
            train_dataset=rows,
            processing_class=build_tokenizer(),
            callbacks=[hf_callback(timer)],
        )
        report["baseline"] = _rss_mib()
        trainer.train()


def run_grpo(runner: str, args: argparse.Namespace, timer: StepTimer) -> None:
    from datasets import Dataset

    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.models import build_tokenizer
    from lit_trainer.modules.grpo import GRPOModule

    half = args.seq // 2
    prompts = Dataset.from_dict({"prompt": texts(args.batch * args.steps, half, 4)})
    model = build_model(args.vocab, args.seq)
    model.generation_config.eos_token_id = None  # every completion runs to max_completion_length
    common = {"num_generations": 2, "max_completion_length": half, "temperature": 1.0}
    generation = {"suppress_tokens": [1], "eos_token_id": None}

    def length_reward(completions: list, **_: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    if runner.startswith("ours"):
        chunked = "off" if runner == "ours-full" else "auto"
        module = GRPOModule(
            model,
            tokenizer=build_tokenizer(),
            reward_funcs=[length_reward],
            learning_rate=1e-5,
            generation_kwargs=generation,
            chunked_logits=chunked,
            **common,
        )
        dm = PromptDataModule(
            tokenizer=build_tokenizer(), dataset=prompts, batch_size=args.batch, max_length=half + 8, val_size=0
        )
        trainer = lightning_trainer(args.steps, timer)
        report["baseline"] = _rss_mib()
        trainer.fit(module, datamodule=dm)
        return
    from trl import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[length_reward],
            args=hf_args(GRPOConfig, out, args, generation_kwargs=generation, **common),
            train_dataset=prompts,
            processing_class=build_tokenizer(),
            callbacks=[hf_callback(timer)],
        )
        report["baseline"] = _rss_mib()
        trainer.train()


RUNS = {"sft": (run_sft, ["ours", "ours-full", "hf"]), "dpo": (run_dpo, ["ours", "ours-full", "trl"])}
RUNS["grpo"] = (run_grpo, ["ours", "ours-full", "trl"])
report: dict[str, float] = {}


def measure(algo: str, runner: str, args: argparse.Namespace) -> dict[str, float]:
    """Run one runner in a fresh process; returns its peak above the pre-training baseline and step time."""
    command = [sys.executable, __file__, "--one", f"{algo}:{runner}"]
    command += ["--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch)]
    command += ["--steps", str(args.steps)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{algo}:{runner} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", default="sft,dpo,grpo")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        algo, runner = args.one.split(":")
        timer = StepTimer()
        RUNS[algo][0](runner, args, timer)
        print(json.dumps({"peak_mib": _rss_mib() - report["baseline"], "step_s": timer.median()}))
        return
    print(f"vocab {args.vocab}, hidden {HIDDEN}, {LAYERS} layers, batch {args.batch} x {args.seq} tokens")
    print("| algorithm | runner | peak above start (MiB) | vs reference | step (s) | vs ours-full |")
    print("|---|---|---|---|---|---|")
    for algo in args.algos.split(","):
        _, runners = RUNS[algo]
        results = {runner: measure(algo, runner, args) for runner in runners}
        reference = results[runners[-1]]
        for runner, r in results.items():
            print(
                f"| {algo} | {runner} | {r['peak_mib']:.0f} | {r['peak_mib'] / reference['peak_mib']:.2f}x | "
                f"{r['step_s']:.2f} | {r['step_s'] / results['ours-full']['step_s']:.2f}x |",
                flush=True,
            )
    if args.table:
        print("\nSFT peak above start (MiB), ours (chunked) / ours-full, by sequence length and vocabulary:")
        print("| vocab | seq | chunked | full |")
        print("|---|---|---|---|")
        for vocab in (32_000, 151_936):
            for seq in (256, 512, 1024):
                sub = argparse.Namespace(**{**vars(args), "vocab": vocab, "seq": seq, "steps": 2})
                chunked, full = measure("sft", "ours", sub), measure("sft", "ours-full", sub)
                print(f"| {vocab} | {seq} | {chunked['peak_mib']:.0f} | {full['peak_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
