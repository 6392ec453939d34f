"""DPO throughput: DPOModule with a live reference vs precomputed reference log-probs, next to SFT on the same rows.

Measured in one run, on the same built-in addition rows and the same starting weights:
  * ``dpo_live``: DPOModule step (one forward of 2B rows through the policy, one no-grad forward through the frozen
    reference, backward, AdamW step);
  * ``dpo_precomputed``: the same with ``ref_chosen_logps``/``ref_rejected_logps`` in the batch (no reference
    forward); the one-off scoring pass is timed separately;
  * ``sft``: CausalLMModule step on the prompt + chosen rows of the same pairs (B rows per step).
Variants run in turn, ``--steps`` steps each, ``--repeats`` rounds (so machine load hits all alike); the table holds
medians. Steps call ``compute_loss`` + backward + optimizer directly (no Trainer overhead, identical for all).
Memory: parameter bytes each module holds; with ``--memory``, each variant in a fresh subprocess (module built, the
precompute pass, two passes of training steps) and its peak resident memory above the baseline after imports and data
setup; on CUDA the peak allocated memory.

Usage: python benchmarks/dpo_throughput.py [--preset tiny] [--pairs 32] [--steps 10] [--repeats 5] [--threads 1]
                                           [--device cpu] [--memory]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import torch
from _common import interleaved_rounds, pair_batches, run_steps

from lit_trainer.models import load_model
from lit_trainer.modules.causal_lm import CausalLMModule
from lit_trainer.modules.dpo import DPOModule

VARIANTS = ("dpo_live", "dpo_precomputed", "sft")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--pairs", type=int, default=32, help="pairs (DPO) / rows (SFT) per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory", action="store_true", help="also measure peak RSS per variant in subprocesses")
    parser.add_argument("--only", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant, print RSS
    return parser.parse_args()


def batches(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """``(preference batches, SFT batches)``: the same pairs, chosen completions only for SFT."""
    data = pair_batches(args.pairs, args.steps, args.device)
    return data["dpo"], data["sft"]


def build(args: argparse.Namespace, variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    policy = load_model(args.preset)
    if variant == "sft":
        return CausalLMModule(policy, learning_rate=1e-4).to(args.device)
    module = DPOModule(
        policy, loss_type=["sigmoid", "sft"], learning_rate=1e-4, precompute_ref_log_probs=variant == "dpo_precomputed"
    )
    return module.to(args.device)


@torch.no_grad()
def precompute(reference: torch.nn.Module, scorer: DPOModule, pref: list[dict]) -> tuple[list[dict], float]:
    """Attach the reference log-probs to each batch; returns the batches and the seconds the pass took."""
    start = time.perf_counter()
    reference.eval()
    out = []
    for batch in pref:
        seq = scorer.score(reference, batch).seq
        half = seq.numel() // 2
        out.append({**batch, "ref_chosen_logps": seq[:half], "ref_rejected_logps": seq[half:]})
    return out, time.perf_counter() - start


def held_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def one_variant(args: argparse.Namespace) -> None:
    """Subprocess mode: build the variant's module(s) and run two passes over the data; print the peak resident memory
    above the baseline after imports and data setup (Linux: the high-water mark is reset through
    ``/proc/self/clear_refs``; elsewhere the lifetime ``ru_maxrss`` is used)."""
    pref, sft = batches(args)
    baseline = 0.0
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        baseline = _status_mib("VmRSS")
    except OSError:
        pass
    module = build(args, args.only)
    if args.only == "dpo_precomputed":
        pref, _ = precompute(module.model, module, pref)  # the policy before any update scores the pairs
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(2):
        run_steps(module, optimizer, sft if args.only == "sft" else pref, args.device)
    try:
        peak = _status_mib("VmHWM")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RSS_MIB {peak - baseline:.1f}")


def memory(args: argparse.Namespace) -> dict[str, float]:
    out = {}
    for variant in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            "--only",
            variant,
            "--preset",
            args.preset,
            "--pairs",
            str(args.pairs),
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--device",
            args.device,
        ]
        text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        out[variant] = float(next(line for line in text.splitlines() if line.startswith("RSS_MIB")).split()[1])
    return out


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    if args.only:
        one_variant(args)
        return
    pref, sft = batches(args)
    modules = {v: build(args, v) for v in VARIANTS}
    live = modules["dpo_live"]
    data = {"dpo_live": pref, "sft": sft}
    data["dpo_precomputed"], precompute_s = precompute(live.ref_model, live, pref)
    optimizers = {
        v: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for v, m in modules.items()
    }
    times, peaks = interleaved_rounds(modules, optimizers, data, args.repeats, args.device)
    rss = memory(args) if args.memory else {}
    tokens = {v: sum(int(b["attention_mask"].sum()) for b in data[v]) for v in VARIANTS}
    rows = {v: sum(b["input_ids"].size(0) for b in data[v]) for v in VARIANTS}
    params = sum(p.numel() for p in modules["sft"].parameters())
    print(f"command: python benchmarks/{' '.join(sys.argv)}".replace("benchmarks/benchmarks/", "benchmarks/"))
    print(
        f"model: preset {args.preset!r} ({params / 1e6:.2f}M parameters), {args.pairs} pairs per step, "
        f"{args.steps} steps x {args.repeats} interleaved rounds, {args.threads} thread(s), device {args.device}"
    )
    header = "| variant | pairs/s | rows/s | tokens/s | step ms | parameter MiB held |"
    extra = (" peak RSS MiB above baseline |" if rss else "") + (" peak CUDA MiB |" if peaks else "")
    print(header + extra)
    print("|" + "---|" * (header.count("|") - 1 + extra.count("|")))
    for v in VARIANTS:
        sec = statistics.median(times[v])
        pairs = f"{args.pairs * args.steps / sec:,.0f}" if v != "sft" else "-"
        line = (
            f"| {v} | {pairs} | {rows[v] / sec:,.0f} | {tokens[v] / sec:,.0f} | {1000 * sec / args.steps:.1f} | "
            f"{held_bytes(modules[v]) / 2**20:.2f} |"
        )
        line += f" {rss[v]:.0f} |" if rss else ""
        line += f" {peaks[v] / 2**20:.1f} |" if peaks else ""
        print(line)
    print(
        f"one-off precompute pass over the {args.pairs * args.steps} pairs: {precompute_s:.2f} s "
        f"({args.pairs * args.steps / precompute_s:,.0f} pairs/s)"
    )


if __name__ == "__main__":
    main()
