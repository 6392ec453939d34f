"""Vision-language SFT cost: CausalLMModule in lightning.Trainer vs a plain torch loop, same batches, side by side.

    OMP_NUM_THREADS=1 python benchmarks/vision_sft.py [--steps 30] [--warmup 5] [--rounds 2] [--batch 32]

The shape of ``configs/sft_vl.yaml``: the ``tiny-vl`` preset (LLaVA: CLIP tower on 32x32 pictures, 16 image tokens
per picture, the tiny Llama), batch 32 of the built-in image task (``builtin:shapes``), ``max_length`` 64, loss on the
answer only, vision tower frozen (the module's default), AdamW (lr 1e-3, no weight decay, torch's fused kernel as the
module's default ``optim``), constant learning rate, clipping at global norm 1.0, fp32.

The ``warmup + steps`` batches are collated once, in the parent process, by ``SFTDataModule`` (the tiny-vl processor,
as in the recipe) and saved; every runner reads the same batches in the same order, from the same initial weights:

  ours   CausalLMModule (its loss, its optimizer) in lightning.Trainer, no logger, checkpointing or progress bar
  torch  a hand-written loop: model(input_ids, attention_mask, pixel_values), shifted cross entropy over the answer
         tokens, backward, clip, AdamW step (the same parameters trainable, the same AdamW implementation)

Each runner runs in its own process, ``--rounds`` times, alternating (so machine load hits both alike). Peak memory is
the process's resident set (RSS) high-water mark (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` after
imports and loading the batches) minus the resident set at that moment: what building the model and training adds
(weights, gradients, AdamW state, activations, and for ``ours`` Lightning's loop). Step time is the median wall time of
the steps after the warm-up, and the median process CPU time (far less sensitive to other jobs on a shared machine),
both taken between consecutive ends of steps (the Trainer's ``on_train_batch_end``, so hooks and logging are in it).
Collation itself (the processor on 32 pictures) is timed once in the parent and reported apart: both runners would pay
it. A sanity line gives the largest per-step loss gap between the two (0 up to float summation order).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

LR, CLIP = 1e-3, 1.0


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> float:
    """Reset the RSS high-water mark (Linux); the current RSS in MiB, the baseline."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status_mib("VmRSS")


def collate(args: argparse.Namespace, path: str) -> dict[str, float]:
    """Collate ``warmup + steps`` batches of the recipe's data with its data module into ``path``; seconds per batch."""
    from lit_trainer.data import SFTDataModule
    from lit_trainer.data.builtin_shapes import sft_rows

    rows = sft_rows("train").select(range(args.batch * (args.warmup + args.steps)))
    data = SFTDataModule(
        tokenizer="tiny-vl",
        dataset=rows,
        val_size=0,
        batch_size=args.batch,
        max_length=64,
        assistant_only_loss=True,
        sampling="sequential",
    )
    data.setup("fit")
    start = time.perf_counter()
    batches = list(data.train_dataloader())
    seconds = (time.perf_counter() - start) / len(batches)
    torch.save(batches, path)
    return {"collate_s": seconds, "keys": sorted(batches[0])}


def build_model() -> Any:
    from lit_trainer.models import load_model

    torch.manual_seed(0)
    return load_model("tiny-vl")


def _deltas(stamps: list[tuple[float, float]], warmup: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step after the first ``warmup`` (from the end of one step to the end of the next)."""
    timed = stamps[max(warmup - 1, 0) :]
    return [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(timed)]


def _trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run_ours(batches: list[dict], warmup: int) -> tuple[list[tuple[float, float]], list[float], str, int]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lit_trainer.modules.causal_lm import CausalLMModule

    stamps: list[tuple[float, float]] = []
    losses: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            stamps.append((time.perf_counter(), time.process_time()))
            losses.append(float(outputs["loss"]))

    module = CausalLMModule(build_model(), tokenizer=None, learning_rate=LR, scheduler="constant", max_grad_norm=CLIP)
    trainer = pl.Trainer(
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Clock()],
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, shuffle=False))
    optimizer = trainer.optimizers[0]
    return _deltas(stamps, warmup), losses, _adamw_kind(optimizer), _trainable(module.model)


def run_torch(batches: list[dict], warmup: int, fused: bool) -> tuple[list[tuple[float, float]], list[float], str, int]:
    import torch.nn.functional as F

    model = build_model()
    model.model.vision_tower.requires_grad_(False)  # as the module's default (train_vision_tower=False)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=fused)
    stamps, losses = [], []
    for batch in batches:
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"]
        ).logits
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append((time.perf_counter(), time.process_time()))
        losses.append(float(loss))
    return _deltas(stamps, warmup), losses, _adamw_kind(optimizer), _trainable(model)


def _adamw_kind(optimizer: torch.optim.Optimizer) -> str:
    group = optimizer.param_groups[0]
    kind = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    return f"{type(optimizer).__name__} {kind}"


def one_runner(args: argparse.Namespace) -> None:
    """Subprocess mode: load the batches, reset the RSS peak, build and train; print one JSON line."""
    torch.set_num_threads(args.threads)
    batches = torch.load(args.batches, weights_only=False)
    # the libraries both runners use are imported before the baseline: their memory is not counted
    for name in ("lightning.pytorch", "lit_trainer.modules.causal_lm", "lit_trainer.models"):
        importlib.import_module(name)
    baseline = _reset_peak()
    if args.only == "ours":
        times, losses, optimizer, trainable = run_ours(batches, args.warmup)
    else:
        times, losses, optimizer, trainable = run_torch(batches, args.warmup, fused=args.fused)
    peak = _status_mib("VmHWM") - baseline
    out = {"peak_mib": peak, "times": times, "losses": losses, "optimizer": optimizer, "trainable": trainable}
    print("RESULT " + json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each runner, alternating")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("ours", "torch"), help=argparse.SUPPRESS)  # internal: one runner
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    parser.add_argument("--fused", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        one_runner(args)
        return
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "batches.pt")
        info = collate(args, path)
        results: dict[str, list[dict]] = {"ours": [], "torch": []}
        fused = True
        for _ in range(args.rounds):
            for runner in ("ours", "torch"):
                cmd = [sys.executable, __file__, "--only", runner, "--batches", path, "--warmup", str(args.warmup)]
                cmd += ["--threads", str(args.threads)] + (["--fused"] if fused else [])
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{runner} failed:\n{proc.stderr[-3000:]}")
                line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
                results[runner].append(json.loads(line.removeprefix("RESULT ")))
                if runner == "ours":  # the plain loop uses the AdamW implementation the module chose
                    fused = results["ours"][-1]["optimizer"].endswith("fused")
    print(
        f"tiny-vl SFT, batch {args.batch}, max_length 64, {args.steps} timed steps after {args.warmup}, "
        f"{args.rounds} rounds, {args.threads} thread(s); collation {info['collate_s'] * 1000:.0f} ms/batch "
        f"(not in the step times); batch keys {info['keys']}"
    )
    print(
        "| runner | AdamW | trainable weights | step wall time, median (ms) | step CPU time, median (ms) "
        "| peak RSS added (MiB), max of rounds |"
    )
    print("|---|---|---|---:|---:|---:|")
    summary = {}
    for runner, runs in results.items():
        wall = statistics.median(t[0] for run in runs for t in run["times"]) * 1000
        cpu = statistics.median(t[1] for run in runs for t in run["times"]) * 1000
        peak = max(run["peak_mib"] for run in runs)
        summary[runner] = (wall, cpu, peak)
        print(f"| {runner} | {runs[0]['optimizer']} | {runs[0]['trainable']:,} | {wall:.1f} | {cpu:.1f} | {peak:.0f} |")
    ours, plain = summary["ours"], summary["torch"]
    ratios = " | ".join(f"{a / b:.2f}x" for a, b in zip(ours, plain))
    print(f"| ours / torch | | | {ratios} |")
    gap = max(abs(a - b) for a, b in zip(results["ours"][0]["losses"], results["torch"][0]["losses"]))
    print(f"sanity: largest per-step loss gap ours vs torch over {len(results['ours'][0]['losses'])} steps: {gap:.2e}")


if __name__ == "__main__":
    main()
