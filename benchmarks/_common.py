"""Code shared by the DPO and LoRA throughput benchmarks: the same pair batches and the same timed steps."""

from __future__ import annotations

import time

import torch
from datasets import Dataset

from lit_trainer.data import builtin
from lit_trainer.data.preference import PreferenceDataModule
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.models import build_tokenizer


def pair_batches(batch_size: int, steps: int, device: str) -> dict[str, list[dict]]:
    """``{"dpo": ..., "sft": ...}``: ``steps`` batches of ``batch_size`` built-in pairs on ``device``, in order:
    SFT trains on the same prompts with the chosen completions."""
    rows = builtin.preference_rows("train").select(range(batch_size * steps))
    common = {
        "tokenizer": build_tokenizer(),
        "val_size": 0,
        "batch_size": batch_size,
        "max_length": 32,
        "sampling": "sequential",
    }
    sft_rows = Dataset.from_dict({"prompt": rows["prompt"], "completion": rows["chosen"]})
    out = {}
    for name, dm in (
        ("dpo", PreferenceDataModule(dataset=rows, **common)),
        ("sft", SFTDataModule(dataset=sft_rows, **common)),
    ):
        dm.setup("fit")
        out[name] = [
            {k: v.to(device) for k, v in b.items() if k != "num_items_in_batch"} for b in dm.train_dataloader()
        ]
    return out


def run_steps(module: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[dict], device: str) -> float:
    """Seconds for one pass of ``compute_loss`` + backward + optimizer step over ``data`` (no Trainer)."""
    module.train()
    start = time.perf_counter()
    for batch in data:
        loss, _ = module.compute_loss(dict(batch), None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved_rounds(
    modules: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    data: dict[str, list[dict]],
    repeats: int,
    device: str,
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """A warm-up of two steps per variant (it also creates the optimizer states), then ``repeats`` rounds that time one
    pass of every variant in turn (so machine load hits all alike); ``(seconds per pass per variant, peak CUDA bytes
    per variant, empty off CUDA)``."""
    for v in modules:
        run_steps(modules[v], optimizers[v], data[v][:2], device)
    times: dict[str, list[float]] = {v: [] for v in modules}
    peaks: dict[str, int] = {}
    for _ in range(repeats):
        for v in modules:
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            times[v].append(run_steps(modules[v], optimizers[v], data[v], device))
            if device.startswith("cuda"):
                peaks[v] = max(peaks.get(v, 0), torch.cuda.max_memory_allocated())
    return times, peaks
