"""GRPO throughput: optimizer steps/s and the share of time spent generating, for steps_per_generation 1, 4 and 8.

Usage::

    python benchmarks/grpo_throughput.py [--preset tiny] [--steps 16] [--batch-size 64] [--num-generations 8]
        [--max-completion-length 8] [--spg 1 4 8] [--threads 1] [--device cpu]

Every configuration trains the same seeded preset on the same prompts (the built-in addition task, same shuffled
order) with ``accumulate_grad_batches=1`` and ``batch_size`` completions per optimizer step, for ``--steps``
optimizer steps (a multiple of every spg). With ``steps_per_generation = k`` the module generates the completions of
``k`` optimizer steps in one batched ``generate`` call (``k * batch_size`` rows), so there are ``steps / k`` calls.

Reported per configuration: steps/s (train loop only, from the first to the last batch), ``generate`` calls, the
seconds inside ``model.generate``, the share of the loop spent generating, the rollout share (generate + rewards +
advantages + buffering), generation seconds per optimizer step, and the measured factor
``gen_s_per_step(spg=1) / gen_s_per_step(spg=k)`` next to the ideal ``k``.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from typing import Any

import lightning as L
import torch


def _timed(fn: Any, totals: dict[str, float], key: str, device: torch.device) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        totals[key] += time.perf_counter() - start
        totals[key + "_calls"] += 1
        return out

    return wrapper


class LoopTimer(L.Callback):
    """Wall time from the start of the first training batch to the end of the last one."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.end = time.perf_counter()


def run(spg: int, args: argparse.Namespace) -> dict[str, float]:
    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.models import load_model, load_tokenizer
    from lit_trainer.modules.grpo import GRPOModule

    L.seed_everything(args.seed, verbose=False)
    model = load_model(args.preset)
    module = GRPOModule(
        model,
        tokenizer=load_tokenizer(args.preset),
        reward_funcs=["lit_trainer.rewards.arithmetic_reward"],
        num_generations=args.num_generations,
        steps_per_generation=spg,
        max_completion_length=args.max_completion_length,
        temperature=0.7,
        learning_rate=1e-4,
        scheduler="constant",
        generation_seed=args.seed,
    )
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    totals = {"generate": 0.0, "generate_calls": 0, "rollout": 0.0, "rollout_calls": 0}
    module.model.generate = _timed(module.model.generate, totals, "generate", device)
    module._make_rollouts = _timed(module._make_rollouts, totals, "rollout", device)
    data = PromptDataModule(
        tokenizer=args.preset, batch_size=args.batch_size, max_length=16, val_size=0, seed=args.seed
    )
    timer = LoopTimer()
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator=args.device,
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=data)
    loop = timer.end - timer.start
    return {
        "spg": spg,
        "loop_s": loop,
        "steps_per_s": args.steps / loop,
        "calls": totals["generate_calls"],
        "gen_s": totals["generate"],
        "gen_share": totals["generate"] / loop,
        "rollout_share": totals["rollout"] / loop,
        "gen_s_per_step": totals["generate"] / args.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64, help="completions per optimizer step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--spg", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if any(args.steps % k for k in args.spg):
        parser.error(f"--steps {args.steps} must be a multiple of every --spg {args.spg}.")
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import datasets

    datasets.disable_progress_bars()
    results = [run(k, args) for k in args.spg]
    base = results[0]["gen_s_per_step"]
    print(
        f"\nGRPO throughput: preset={args.preset}, {args.batch_size} completions/step "
        f"({args.batch_size // args.num_generations} prompts x {args.num_generations}), max_completion_length="
        f"{args.max_completion_length}, {args.steps} optimizer steps, device={args.device}, threads={args.threads}"
    )
    header = (
        f"{'spg':>4} {'steps/s':>8} {'generate calls':>15} {'gen s':>7} {'gen share':>10} {'rollout share':>14} "
        f"{'gen s/step':>11} {'gen cost factor':>16} {'ideal':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        factor = base / r["gen_s_per_step"] if r["gen_s_per_step"] else float("nan")
        print(
            f"{r['spg']:>4} {r['steps_per_s']:>8.2f} {r['calls']:>15} {r['gen_s']:>7.2f} {r['gen_share']:>9.0%} "
            f"{r['rollout_share']:>13.0%} {r['gen_s_per_step']:>11.4f} {factor:>15.2f}x {r['spg']:>5}x"
        )
    print(f"\ncommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")


if __name__ == "__main__":
    main()
