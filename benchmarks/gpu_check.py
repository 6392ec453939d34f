"""A prepared GPU check, NOT part of CI: one run of a few minutes on one (or two) CUDA devices.

    python benchmarks/gpu_check.py [--model tiny-256] [--steps 30]

What it does (each part prints one line; a failure stops the run with its traceback):
1. bf16-mixed steps on CUDA, one device: ``CausalLMModule`` (SFT), ``DPOModule``, ``GRPOModule``; checks the loss is
   finite and the weights moved.
2. The FSDP2 path: ``ModelParallelStrategy(data_parallel_size=1)`` with ``devices=1`` and bf16 mixed precision
   (``shard_param_dtype="bfloat16"``), then, when 2 GPUs are visible, the same SFT with ``devices=2`` (a second launch
   of this script, ``--part fsdp2``), for SFT, DPO and GRPO (generation with ``synced_gpus``).
3. An ``HFExport`` round trip under FSDP2: the export loads with ``from_pretrained`` and gives the module's logits.
4. QLoRA on CUDA: ``CausalLMModule`` with an NF4 base (bfloat16 compute), LoRA and ``paged_adamw_8bit`` (paging is
   real only on CUDA); checks the adapters moved, the packed base did not, and the merged export loads.
5. SFT tokens/s and peak CUDA memory of ``CausalLMModule`` in ``lightning.Trainer`` (bf16-mixed) next to
   ``transformers.Trainer`` (``bf16=True``; needs ``accelerate``) on the same model, batches and optimizer settings.
Put the printed figures in docs/benchmarks.md ("Figures") with the GPU name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_trainer.callbacks import HFExport
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.prompt import PromptDataModule
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.modules import CausalLMModule, DPOModule, GRPOModule


def trainer(steps: int, devices: int = 1, sharded: bool = False, callbacks: list | None = None) -> pl.Trainer:
    strategy: Any = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if sharded else "auto"
    return pl.Trainer(
        accelerator="cuda",
        devices=devices,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks or [],
    )


def first_weight(module: pl.LightningModule) -> torch.Tensor:
    from lit_trainer.core.sharding import full

    return full(next(module.model.parameters()).detach()).float().cpu().clone()


def run_module(name: str, module: pl.LightningModule, datamodule: Any, steps: int, **kwargs: Any) -> pl.Trainer:
    before = first_weight(module)
    fit = trainer(steps, **kwargs)
    fit.fit(module, datamodule=datamodule)
    moved = not torch.equal(before, first_weight(module))
    loss = float(fit.callback_metrics.get("train_loss", torch.tensor(float("nan"))))
    if fit.is_global_zero:
        print(
            f"[gpu_check] {name}: {fit.global_step} steps, weights moved: {moved}, last logged loss {loss:.4f}, "
            f"peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB",
            flush=True,
        )
    assert moved, f"{name}: the weights did not change"
    return fit


def modules(model: str, sharded: bool) -> list[tuple[str, pl.LightningModule, Any]]:
    shard = {"shard_param_dtype": "bfloat16"} if sharded else {}
    grpo = GRPOModule(
        model,
        reward_funcs=["lit_trainer.rewards.arithmetic_reward"],
        num_generations=4,
        max_completion_length=8,
        beta=0.04,
        **shard,
    )
    return [
        (
            "SFT",
            CausalLMModule(model, learning_rate=1e-3, **shard),
            SFTDataModule(model, batch_size=16, max_length=32, val_size=0),
        ),
        (
            "DPO",
            DPOModule(model, learning_rate=1e-4, **shard),
            PreferenceDataModule(model, batch_size=8, max_length=32, val_size=0),
        ),
        ("GRPO", grpo, PromptDataModule(model, batch_size=4, max_length=32, val_size=0)),
    ]


def part_modules(args: argparse.Namespace, sharded: bool, devices: int) -> None:
    for name, module, datamodule in modules(args.model, sharded):
        tag = f"{name} {'FSDP2' if sharded else 'single'} devices={devices}"
        run_module(tag, module, datamodule, args.steps if name != "GRPO" else 4, devices=devices, sharded=sharded)


def part_export(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as out:
        module = CausalLMModule(args.model, learning_rate=1e-3)
        fit = trainer(5, sharded=True, callbacks=[HFExport(out)])
        fit.fit(module, datamodule=SFTDataModule(args.model, batch_size=16, max_length=32, val_size=0))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).cuda().eval()
        ids = torch.randint(3, 100, (2, 16), device="cuda")
        module.model.eval()
        with torch.no_grad():
            diff = (loaded(ids).logits - module.model(input_ids=ids).logits).abs().max().item()
        print(f"[gpu_check] HFExport under FSDP2: from_pretrained OK, max |logit diff| {diff:.2e}", flush=True)
        assert diff < 1e-4


def part_qlora(args: argparse.Namespace) -> None:
    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    quantization["bnb_4bit_compute_dtype"] = "bfloat16"
    module = CausalLMModule(
        args.model,
        quantization=quantization,
        peft_config={"r": 16, "target_modules": "all-linear"},
        optim="paged_adamw_8bit",
        learning_rate=1e-3,
    )
    base = {n: p.detach().clone() for n, p in module.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    with tempfile.TemporaryDirectory() as out:
        fit = trainer(args.steps, callbacks=[HFExport(out, merge_adapters=True)])
        fit.fit(module, datamodule=SFTDataModule(args.model, batch_size=16, max_length=32, val_size=0))
        after = dict(module.model.named_parameters())
        moved = all(not torch.equal(v.cpu(), after[n].detach().cpu()) for n, v in adapters.items() if "lora_B" in n)
        kept = all(torch.equal(v.cpu(), after[n].detach().cpu()) for n, v in base.items())
        merged = transformers.AutoModelForCausalLM.from_pretrained(out)
        print(
            f"[gpu_check] QLoRA (NF4, bf16 compute, paged 8-bit AdamW): {fit.global_step} steps, every lora_B moved: "
            f"{moved}, packed base unchanged: {kept}, merged export loads ({merged.dtype}), peak memory "
            f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB",
            flush=True,
        )
        assert moved and kept


def part_throughput(args: argparse.Namespace) -> None:
    """Same model, rows in the same order, AdamW lr 1e-4, clipping 1.0, batch 16, bf16 autocast."""
    steps, batch = args.steps * 4, 16
    dm = SFTDataModule(args.model, batch_size=batch, max_length=64, val_size=0, sampling="sequential")
    dm.setup("fit")
    rows = dm.train_dataset.select(range(steps * batch))
    tokens = sum(len(r) for r in rows["input_ids"])
    torch.cuda.reset_peak_memory_stats()
    module = CausalLMModule(args.model, learning_rate=1e-4, max_grad_norm=1.0, scheduler="constant")
    start = time.perf_counter()
    trainer(steps).fit(module, datamodule=dm)
    ours = (tokens / (time.perf_counter() - start), torch.cuda.max_memory_allocated() / 2**20)
    print(f"[gpu_check] ours: {ours[0]:,.0f} tokens/s, peak {ours[1]:.0f} MiB", flush=True)
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("[gpu_check] transformers.Trainer skipped: `pip install accelerate`", flush=True)
        return
    from lit_trainer.models import load_model

    del module
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    collator = transformers.DataCollatorForSeq2Seq(dm.tokenizer, padding=True, label_pad_token_id=-100)
    with tempfile.TemporaryDirectory() as out:
        hf = transformers.Trainer(
            model=load_model(args.model),
            train_dataset=rows.select_columns(["input_ids", "attention_mask", "labels"]),
            data_collator=collator,
            args=transformers.TrainingArguments(
                output_dir=out,
                per_device_train_batch_size=batch,
                max_steps=steps,
                learning_rate=1e-4,
                lr_scheduler_type="constant",
                max_grad_norm=1.0,
                bf16=True,
                report_to="none",
                save_strategy="no",
                disable_tqdm=True,
                train_sampling_strategy="sequential",
                logging_steps=50,
            ),
        )
        start = time.perf_counter()
        hf.train()
        theirs = (tokens / (time.perf_counter() - start), torch.cuda.max_memory_allocated() / 2**20)
    print(
        f"[gpu_check] transformers.Trainer: {theirs[0]:,.0f} tokens/s, peak {theirs[1]:.0f} MiB; ours / HF: "
        f"{ours[0] / theirs[0]:.3f}x tokens/s, {ours[1] / theirs[1]:.3f}x memory (tokens counted with padding "
        "excluded, the same rows for both)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-256")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--part", choices=["all", "fsdp2"], default="all", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device.")
    print(
        f"[gpu_check] {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s), torch "
        f"{torch.__version__}",
        flush=True,
    )
    if args.part == "fsdp2":  # the 2-device launch (Lightning re-runs this command line for rank 1)
        part_modules(args, sharded=True, devices=2)
        return
    part_modules(args, sharded=False, devices=1)
    part_modules(args, sharded=True, devices=1)
    part_export(args)
    part_qlora(args)
    part_throughput(args)
    if torch.cuda.device_count() >= 2:
        subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps), "--part", "fsdp2"],
            check=True,
            env=os.environ.copy(),
        )
    else:
        print("[gpu_check] FSDP2 with devices=2 skipped: one GPU visible", flush=True)


if __name__ == "__main__":
    main()
