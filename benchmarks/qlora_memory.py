"""QLoRA vs LoRA vs full fine-tuning: parameter, optimizer-state and peak resident memory; QLoRA's step-time cost.

One run builds a randomly initialised Llama (``LlamaConfig``; default hidden 1024, intermediate 2816, 8 layers, 16
heads, vocab 32,000, untied head: 168M parameters), saves it with ``save_pretrained`` (float32 by default) and the
presets' tokenizer to a temporary folder, and trains four ``CausalLMModule`` variants loaded from that folder:
  * ``full``: every weight, torch fused AdamW (the default ``optim``);
  * ``lora``: LoRA r=16 (lora_alpha 2r) on every linear layer, the base as saved, fused AdamW;
  * ``qlora``: the same adapters on a base loaded with ``quantization="nf4"`` (NF4 + double quantization, compute
    dtype = the checkpoint's), fused AdamW;
  * ``qlora_adam8``: ``qlora`` with ``optim="adamw_8bit"`` (bitsandbytes' block-wise 8-bit Adam state).
Each variant runs in its own subprocess: batch made, imports done (bitsandbytes and peft included), then the baseline
is read and the high-water mark reset (``/proc/self/clear_refs``); the module is built and trains ``--steps`` steps
(``compute_loss`` + backward + the module's ``create_optimizer`` step, no Trainer) on one batch of random tokens.
Columns:
  * parameters MiB: bytes the module holds in parameters and buffers plus the tensors of each 4-bit weight's
    ``quant_state`` (uint8 absmax, the nested float32 absmax, the code books, the offset), each tensor once; this is
    the module's ``state_dict`` minus the serialized ``quant_state.bitsandbytes__nf4`` JSON entries (a save format,
    not memory) and with the code books shared by several layers counted once;
  * optimizer MiB: tensors in ``optimizer.state`` after the steps (moments, step counters, the uint8 states with their
    absmax; bitsandbytes' two 256-entry code books are one tensor shared by every parameter, counted once);
  * peak RSS MiB: the subprocess's VmHWM at the end, as ``/usr/bin/time -v`` or a job's memory limit sees it: what a
    user of ``CausalLMModule(path, quantization=...)`` gets with default settings (glibc's default allocator, the
    interpreter and imports included); then the baseline, its VmRSS before the module is built (Python, torch,
    transformers, bitsandbytes, peft, lit_trainer and the batch), the peak above it, and, sampled every 5 ms, the
    peak anonymous part (RssAnon) and the file-backed pages of the memory-mapped checkpoint (RssFile at the end),
    both above the baseline. On CPU, transformers loads a safetensors file memory-mapped and the weights it does not
    convert stay views of that mapping: the whole frozen base of ``lora`` is file-backed (clean pages the kernel may
    drop under pressure), not anonymous. A quantized load copies its unquantized weights (embeddings, head, norms)
    out of the mapping (``lit_trainer.quantization``): before it did, they kept the whole float32 file mapped with
    every page read while quantizing resident, 711 MiB here, and QLoRA's peak was above LoRA's.
    Nothing else stays referenced: after the quantized load the live tensors outside the module are the 1.6 MiB of
    quantization constants. What the peak holds beyond the live tensors is glibc's: with its default adaptive mmap
    threshold (raised up to 32 MiB by the first large frees), activation buffers come from the heap and freed ones
    stay resident there, 400-700 MiB here (the process's anonymous memory after the backward stays at the forward's
    level). ``--malloc-threshold`` runs the subprocesses with ``MALLOC_MMAP_THRESHOLD_=1048576`` instead: every freed
    block of 1 MiB or more goes back to the system at once, so the peaks follow the live tensors (repeat runs within
    ~5 MiB; glibc's default moves them by ±150 MiB), at the cost of page faults on every large allocation (2-4x the
    minor faults, 0.3-0.7 s more system time per step and a 5-7% slower step here).
Step time (none with ``--rounds 0``): the ``lora`` and ``qlora`` modules side by side in this process (glibc's
default allocator), one step of each per round, alternating which goes first, after one warm-up step each (load from
another process hits both alike); medians, the median of the per-round QLoRA / LoRA ratios, and the ratio of the
fastest steps (the least disturbed by other load). Then one more step of each under ``torch.profiler``: the time
QLoRA spends in bitsandbytes' dequantization (each 4-bit weight is dequantized in the forward and again in the
backward for the input gradient, since only the packed weight is kept) and in the matrix products of both.

Usage: python benchmarks/qlora_memory.py [--hidden 1024] [--intermediate 2816] [--layers 8] [--heads 16]
                                         [--vocab 32000] [--tied] [--dtype float32] [--batch 4] [--seq 128]
                                         [--steps 3] [--rounds 10] [--rank 16] [--threads 2]
                                         [--malloc-threshold]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from _machine import cpu_model

VARIANTS = ("full", "lora", "qlora", "qlora_adam8")
LABELS = {
    "full": "full fine-tuning (fused AdamW)",
    "lora": "LoRA, {dtype} base",
    "qlora": "QLoRA (NF4 + double quant)",
    "qlora_adam8": "QLoRA + 8-bit AdamW",
}
MIB = 2**20
MMAP_THRESHOLD = 2**20  # --malloc-threshold: blocks from 1 MiB up are mmapped and unmapped when freed (docstring)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tied", action="store_true", help="tie the head to the embeddings")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of the checkpoint")
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="training steps per memory subprocess")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved LoRA/QLoRA step-time rounds (0: none)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA r (lora_alpha = 2r)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--malloc-threshold",
        action="store_true",
        help=f"run the memory subprocesses with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (peaks follow the live "
        "tensors) instead of glibc's default (what a user gets: freed buffers stay in the heap)",
    )
    parser.add_argument("--only", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant's memory
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # internal: the saved model
    return parser.parse_args()


def quiet() -> None:
    """No progress bars nor the deprecation warning peft triggers in transformers (the output goes into the docs)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def save_model(args: argparse.Namespace, folder: str) -> int:
    """Build the Llama, save it (``--dtype``) and the presets' tokenizer to ``folder``; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_trainer.models import build_tokenizer

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        tie_word_embeddings=args.tied,
        max_position_embeddings=max(2048, args.seq),
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def build(folder: str, variant: str, rank: int) -> Any:
    from lit_trainer.modules.causal_lm import CausalLMModule

    lora = {"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear"}
    kwargs: dict[str, Any] = {
        "full": {},
        "lora": {"peft_config": lora},
        "qlora": {"peft_config": lora, "quantization": "nf4"},
        "qlora_adam8": {"peft_config": lora, "quantization": "nf4", "optim": "adamw_8bit"},
    }[variant]
    torch.manual_seed(0)
    return CausalLMModule(folder, learning_rate=1e-4, **kwargs)


def make_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train_step(module: Any, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    """One ``compute_loss`` + backward + optimizer step; returns its seconds."""
    start = time.perf_counter()
    loss, _ = module.compute_loss(dict(batch), None)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    if not torch.isfinite(loss.detach()):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    return seconds


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each (same address and size) once."""
    seen = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(size for _, size in seen)


def quant_constants(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of every 4-bit weight's ``quant_state`` (absmax, code book, offset, and the nested ones)."""
    out = []
    for layer in module.modules():
        state = getattr(getattr(layer, "weight", None), "quant_state", None)
        for owner in (state, getattr(state, "state2", None)):
            for name in ("absmax", "code", "offset"):
                value = getattr(owner, name, None)
                if torch.is_tensor(value):
                    out.append(value)
    return out


def memory_report(module: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    packed = [p for p in module.parameters() if type(p).__name__ == "Params4bit"]
    constants = quant_constants(module)
    opt = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    eight_bit = [
        s for s in optimizer.state.values() if torch.is_tensor(s.get("state1")) and s["state1"].dtype == torch.uint8
    ]
    trainable = [p for _, p in module.trainable_parameters()]
    return {
        "param_bytes": tensor_bytes([*module.parameters(), *module.buffers(), *constants]),
        "packed_bytes": tensor_bytes(packed),
        "constant_bytes": tensor_bytes(constants),
        "quantized_values": sum(p.quant_state.shape.numel() for p in packed),
        "quantized_tensors": len(packed),
        "trainable": sum(p.numel() for p in trainable),
        "trainable_bytes": tensor_bytes(trainable),
        "optimizer_bytes": tensor_bytes(opt),
        "optimizer_8bit_tensors": len(eight_bit),
        "optimizer_tensors": len(optimizer.state),
        "state_bytes_uint8": tensor_bytes(t for t in opt if t.dtype == torch.uint8),
    }


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """Reads ``proc_status`` every 5 ms until stopped; keeps the largest RssAnon."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.peak_anon = 0

    def run(self) -> None:
        while not self.stop.wait(0.005):
            self.peak_anon = max(self.peak_anon, proc_status()["RssAnon"])


def one_variant(args: argparse.Namespace) -> None:
    """Subprocess mode: build ``args.only`` from ``args.folder``, train ``args.steps`` steps, print the measures."""
    import bitsandbytes  # noqa: F401  (imported by every variant before the baseline: its memory is not the model's)
    import peft  # noqa: F401

    quiet()
    torch.set_num_threads(args.threads)
    import lit_trainer.modules.causal_lm  # noqa: F401  (the rest of the imports: in the baseline, as for a user)

    batch = make_batch(args)
    gc.collect()
    base = proc_status()  # the high-water mark is not reset: the peak is the whole process's, as a user measures it
    sampler = Sampler()
    sampler.start()
    module = build(args.folder, args.only, args.rank)
    module.train()
    optimizer = module.create_optimizer(list(module.trainable_parameters()))
    for _ in range(args.steps):
        train_step(module, optimizer, batch)
    end = proc_status()
    sampler.stop.set()
    sampler.join()
    report = memory_report(module, optimizer)
    report |= {
        "peak_process": end["VmHWM"],
        "peak_rss": end["VmHWM"] - base["VmRSS"],
        "peak_anon": max(sampler.peak_anon, end["RssAnon"]) - base["RssAnon"],
        "file_pages": end["RssFile"] - base["RssFile"],
        "baseline_rss": base["VmRSS"],
    }
    print("RESULT " + json.dumps(report))


def run_variant(args: argparse.Namespace, variant: str, folder: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--only", variant, "--folder", folder]
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # glibc's default unless asked: what a user gets
    if args.malloc_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


@contextmanager
def no_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null inside the block (the profiler's native start/stop lines)."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def profiled_step(module: Any, optimizer: torch.optim.Optimizer, batch: dict) -> tuple[float, dict[str, tuple]]:
    """One step under ``torch.profiler``: ``(seconds, {op: (self CPU ms, calls)})``."""
    from torch.profiler import ProfilerActivity, profile

    with no_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = train_step(module, optimizer, batch)
    return seconds, {e.key: (e.self_cpu_time_total / 1000, e.count) for e in prof.key_averages()}


def step_times(args: argparse.Namespace, folder: str) -> tuple[dict[str, list[float]], dict[str, tuple]]:
    """Interleaved LoRA and QLoRA steps in this process, then one profiled step of each: ``(seconds per variant,
    {variant: profiled_step(...)})``."""
    batch = make_batch(args)
    modules = {v: build(folder, v, args.rank) for v in ("lora", "qlora")}
    optimizers = {v: m.create_optimizer(list(m.trainable_parameters())) for v, m in modules.items()}
    for v, module in modules.items():
        module.train()
        train_step(module, optimizers[v], batch)  # warm-up; creates the optimizer state
    times: dict[str, list[float]] = {v: [] for v in modules}
    for r in range(args.rounds):
        for v in ("lora", "qlora") if r % 2 == 0 else ("qlora", "lora"):
            times[v].append(train_step(modules[v], optimizers[v], batch))
    return times, {v: profiled_step(modules[v], optimizers[v], batch) for v in modules}


def main() -> None:
    args = parse()
    if args.only:
        one_variant(args)
        return
    start, load_before = time.perf_counter(), os.getloadavg()
    quiet()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="qlora_memory_") as folder:
        params = save_model(args, folder)
        file_bytes = sum(
            os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")
        )
        gc.collect()
        results = {v: run_variant(args, v, folder) for v in VARIANTS}
        load_memory = os.getloadavg()
        times, profiles = step_times(args, folder) if args.rounds > 0 else ({}, {})
    total = time.perf_counter() - start

    print(f"command: python benchmarks/{' '.join(sys.argv)}".replace("benchmarks/benchmarks/", "benchmarks/"))
    head = "untied head" if not args.tied else "head tied to the embeddings"
    print(
        f"model: Llama (hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, {args.heads} "
        f"heads, vocab {args.vocab}, {head}), {params / 1e6:.1f}M parameters, saved in {args.dtype}; batch "
        f"{args.batch} x {args.seq} random tokens, {args.steps} steps per variant, LoRA r={args.rank} on all linear "
        f"layers, {args.threads} thread(s); checkpoint file {file_bytes / MIB:.0f} MiB; memory subprocesses with "
        + (f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}" if args.malloc_threshold else "glibc's default malloc")
    )
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} cores; 1-minute load average {load_before[0]:.2f} at the start, "
        f"{load_memory[0]:.2f} after the memory subprocesses, {os.getloadavg()[0]:.2f} at the end"
    )
    print()
    print(
        "| variant | trainable params | parameters MiB | optimizer MiB | peak RSS MiB | of it the baseline | "
        "above the baseline | of it anonymous | mapped checkpoint MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        r = results[v]
        print(
            f"| {LABELS[v].format(dtype=args.dtype)} | {r['trainable'] / 1e6:.2f}M | {r['param_bytes'] / MIB:.1f} | "
            f"{r['optimizer_bytes'] / MIB:.2f} | {r['peak_process'] / MIB:.0f} | {r['baseline_rss'] / MIB:.0f} | "
            f"{r['peak_rss'] / MIB:.0f} | {r['peak_anon'] / MIB:.0f} | {r['file_pages'] / MIB:.0f} |"
        )
    print(
        f"- peaks: QLoRA / LoRA x{results['qlora']['peak_process'] / results['lora']['peak_process']:.2f}, "
        f"QLoRA + 8-bit AdamW / LoRA x{results['qlora_adam8']['peak_process'] / results['lora']['peak_process']:.2f}, "
        f"QLoRA / full x{results['qlora']['peak_process'] / results['full']['peak_process']:.2f} (above the "
        f"baseline: x{results['qlora']['peak_rss'] / results['lora']['peak_rss']:.2f}, "
        f"x{results['qlora_adam8']['peak_rss'] / results['lora']['peak_rss']:.2f}, "
        f"x{results['qlora']['peak_rss'] / results['full']['peak_rss']:.2f})"
    )
    print()
    full, lora, qlora, adam8 = (results[v] for v in VARIANTS)
    values = qlora["quantized_values"]
    bits = 8 * (qlora["packed_bytes"] + qlora["constant_bytes"]) / values
    width = 32 if args.dtype == "float32" else 16
    rest = qlora["param_bytes"] - qlora["packed_bytes"] - qlora["constant_bytes"] - qlora["trainable_bytes"]
    print(
        f"- 4-bit base: {qlora['quantized_tensors']} linear weights, {values / 1e6:.1f}M values: "
        f"{qlora['packed_bytes'] / MIB:.2f} MiB packed + {qlora['constant_bytes'] / MIB:.2f} MiB quantization "
        f"constants = {bits:.3f} bits per value: x{bits / 32:.4f} of float32 (1/{32 / bits:.2f}), "
        f"x{bits / 16:.4f} of bfloat16 (1/{16 / bits:.2f}); the same weights in the {args.dtype} checkpoint: "
        f"{values * width / 8 / MIB:.1f} MiB"
    )
    print(
        f"- not quantized (embeddings, lm_head, norms; float32 after the k-bit preparation): {rest / MIB:.1f} MiB; "
        f"LoRA adapters {qlora['trainable_bytes'] / MIB:.1f} MiB; parameters vs full: LoRA "
        f"x{lora['param_bytes'] / full['param_bytes']:.3f}, QLoRA x{qlora['param_bytes'] / full['param_bytes']:.3f}"
    )
    print(
        f"- optimizer state: 8-bit AdamW / torch AdamW = x{adam8['optimizer_bytes'] / qlora['optimizer_bytes']:.3f} "
        f"({adam8['optimizer_8bit_tensors']} of {adam8['optimizer_tensors']} tensors with 8-bit state; uint8 "
        f"moments {adam8['state_bytes_uint8'] / MIB:.2f} MiB of {adam8['optimizer_bytes'] / MIB:.2f} MiB); "
        f"full / LoRA = x{full['optimizer_bytes'] / lora['optimizer_bytes']:.1f}"
    )
    if not times:
        print(f"- total run time: {total:.0f} s (no step times: --rounds 0)")
        return
    med = {v: statistics.median(t) for v, t in times.items()}
    ratios = [q / lo for q, lo in zip(times["qlora"], times["lora"])]
    print(
        f"- step time ({args.rounds} interleaved rounds, median): LoRA {med['lora']:.2f} s, QLoRA {med['qlora']:.2f} "
        f"s: QLoRA / LoRA x{med['qlora'] / med['lora']:.2f} "
        f"(median of per-round ratios x{statistics.median(ratios):.2f}; fastest steps {min(times['lora']):.2f} s and "
        f"{min(times['qlora']):.2f} s: x{min(times['qlora']) / min(times['lora']):.2f}; rounds "
        f"{', '.join(f'x{x:.2f}' for x in ratios)})"
    )
    (lora_s, lora_ops), (qlora_s, qlora_ops) = profiles["lora"], profiles["qlora"]
    dequant = [qlora_ops.get(f"bitsandbytes::{op}", (0.0, 0)) for op in ("dequantize_4bit", "dequantize_blockwise")]
    mm = {v: ops.get("aten::mm", (0.0, 0))[0] for v, ops in (("lora", lora_ops), ("qlora", qlora_ops))}
    print(
        f"- one profiled step each: LoRA {lora_s:.2f} s, QLoRA {qlora_s:.2f} s ({1000 * (qlora_s - lora_s):+.0f} ms); "
        f"in QLoRA's: dequantize_4bit {dequant[0][0]:.0f} ms ({dequant[0][1]} calls: forward + backward) + "
        f"dequantize_blockwise (the nested absmax) {dequant[1][0]:.0f} ms ({dequant[1][1]} calls); matrix products "
        f"(aten::mm) {mm['qlora']:.0f} ms vs LoRA's {mm['lora']:.0f} ms"
    )
    print(f"- total run time: {total:.0f} s")


if __name__ == "__main__":
    main()
