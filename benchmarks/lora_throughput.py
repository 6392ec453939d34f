"""LoRA vs full fine-tuning: tokens/s and memory of SFT and DPO on the same model and batches; gradient checkpointing.

Measured in one run, from the same starting weights, on the same built-in addition batches:
  * ``sft_full`` / ``sft_lora``: CausalLMModule step (forward, backward, AdamW step) training all weights vs LoRA
    adapters (``peft_config``, default r=16 on every linear layer); ``*_gc`` with ``gradient_checkpointing=True``;
  * ``dpo_full`` / ``dpo_lora``: DPOModule step with a live reference: a frozen full copy of the policy vs the same
    network with its adapters disabled (no copy).
Columns: tokens/s (median over interleaved rounds), parameter MiB the module holds (policy + reference copy),
optimizer-state MiB after the steps (AdamW moments), and activation MiB saved for backward by one training forward
(summed over the tensors autograd packs, counted once per storage; on CUDA also the peak allocated memory of a step),
and the checkpoint size (module state_dict as the module saves it, plus the optimizer state).
Steps call ``compute_loss`` + backward + optimizer directly (no Trainer overhead, identical for all variants).

Usage: python benchmarks/lora_throughput.py [--preset tiny-256] [--rows 32] [--steps 5] [--repeats 3] [--rank 16]
                                            [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys

import torch
from _common import interleaved_rounds, pair_batches

from lit_trainer.models import load_model
from lit_trainer.modules.causal_lm import CausalLMModule
from lit_trainer.modules.dpo import DPOModule

VARIANTS = ("sft_full", "sft_full_gc", "sft_lora", "sft_lora_gc", "dpo_full", "dpo_lora")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny-256")
    parser.add_argument("--rows", type=int, default=32, help="rows (SFT) / pairs (DPO) per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--rank", type=int, default=16, help="LoRA r (lora_alpha = 2r)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def build(args: argparse.Namespace, variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    lora = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": "all-linear"} if "lora" in variant else None
    kw = {"peft_config": lora, "gradient_checkpointing": variant.endswith("_gc"), "learning_rate": 1e-4}
    if variant.startswith("sft"):
        return CausalLMModule(load_model(args.preset), **kw).to(args.device)
    return DPOModule(load_model(args.preset), loss_type=["sigmoid", "sft"], **kw).to(args.device)


def mib(tensors: list[torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def optimizer_mib(optimizer: torch.optim.Optimizer) -> float:
    return mib([v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.ndim])


def checkpoint_mib(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Serialized size of what a Lightning checkpoint holds for the module: its (filtered) state_dict + optimizer."""
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    module.on_save_checkpoint(checkpoint)  # under peft: the frozen weights are dropped
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getbuffer().nbytes / 2**20


def saved_activation_mib(module: torch.nn.Module, batch: dict) -> float:
    """MiB of the tensors autograd saves for backward during one training forward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = module.compute_loss(dict(batch), None)
    del loss
    return sum(seen.values()) / 2**20


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    data = pair_batches(args.rows, args.steps, args.device)
    modules = {v: build(args, v) for v in VARIANTS}
    feeds = {v: data[v[:3]] for v in VARIANTS}
    optimizers = {v: torch.optim.AdamW([p for _, p in m.trainable_parameters()], lr=1e-4) for v, m in modules.items()}
    activations = {v: saved_activation_mib(m, feeds[v][0]) for v, m in modules.items()}
    times, peaks = interleaved_rounds(modules, optimizers, feeds, args.repeats, args.device)
    tokens = {v: sum(int(b["attention_mask"].sum()) for b in feeds[v]) for v in VARIANTS}
    params = sum(p.numel() for p in modules["sft_full"].parameters())
    trainable = sum(p.numel() for _, p in modules["sft_lora"].trainable_parameters())
    print(f"command: python benchmarks/{' '.join(sys.argv)}".replace("benchmarks/benchmarks/", "benchmarks/"))
    print(
        f"model: preset {args.preset!r} ({params / 1e6:.2f}M parameters; LoRA r={args.rank} on all linear layers: "
        f"{trainable / 1e6:.3f}M trainable), {args.rows} rows/pairs per step, {args.steps} steps x {args.repeats} "
        f"interleaved rounds, {args.threads} thread(s), device {args.device}"
    )
    header = (
        "| variant | tokens/s | step ms | parameter MiB held | optimizer MiB | saved activations MiB | checkpoint MiB |"
    )
    extra = " peak CUDA MiB |" if peaks else ""
    print(header + extra)
    print("|" + "---|" * (header.count("|") - 1 + extra.count("|")))
    stats = {}
    for v in VARIANTS:
        sec = statistics.median(times[v])
        stats[v] = (tokens[v] / sec, mib(list(modules[v].parameters())), optimizer_mib(optimizers[v]))
        line = (
            f"| {v} | {stats[v][0]:,.0f} | {1000 * sec / args.steps:.1f} | {stats[v][1]:.2f} | "
            f"{stats[v][2]:.3f} | {activations[v]:.2f} | {checkpoint_mib(modules[v], optimizers[v]):.2f} |"
        )
        print(line + (f" {peaks[v] / 2**20:.1f} |" if peaks else ""))
    for full, lora in (("sft_full", "sft_lora"), ("dpo_full", "dpo_lora")):
        print(
            f"{lora} / {full}: tokens/s x{stats[lora][0] / stats[full][0]:.2f}, parameter memory "
            f"x{stats[lora][1] / stats[full][1]:.2f}, parameter + optimizer memory "
            f"x{sum(stats[lora][1:]) / sum(stats[full][1:]):.2f}"
        )
    for base in ("sft_full", "sft_lora"):
        print(
            f"{base}_gc / {base}: saved activations x{activations[base + '_gc'] / activations[base]:.2f}, "
            f"tokens/s x{stats[base + '_gc'][0] / stats[base][0]:.2f}"
        )


if __name__ == "__main__":
    main()
