"""The README main job at several seeds: greedy exact match at every validation, median and minimum of the last one.

Runs ``lit-trainer fit --config configs/sft.yaml --seed_everything S`` for each seed, each in its own process and temp
folder, ``--jobs`` at a time, and reads ``val_exact_match`` from each run's ``metrics.csv``. Any further argument is
passed to every run (e.g. ``--trainer.max_steps 1500`` for the former schedule). Wall time depends on what else runs;
CPU seconds (the run's user + system time) much less so.

Usage: python benchmarks/sft_seeds.py [--seeds 1 2 3 4 5] [--jobs 1] [-- extra lit-trainer arguments]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start(seed: int, root: str, extra: list[str]) -> subprocess.Popen:
    """One run of the main job at ``seed``, writing under ``root``."""
    script = str(Path(sys.executable).parent / "lit-trainer")
    job = ["fit", "--config", "configs/sft.yaml", "--seed_everything", str(seed), "--trainer.default_root_dir", root]
    quiet = ["--trainer.enable_progress_bar", "false"]
    return subprocess.Popen([script, *job, *quiet, *extra], cwd=ROOT, stdout=subprocess.DEVNULL)


def exact_match_history(root: str) -> list[tuple[int, float]]:
    """``(step, val_exact_match)`` of every validation of the one run under ``root``."""
    (path,) = Path(root).rglob("metrics.csv")
    with open(path) as f:
        return [(int(r["step"]) + 1, float(r["val_exact_match"])) for r in csv.DictReader(f) if r["val_exact_match"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses torch's default threads)")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        pending, running, results = list(args.seeds), {}, {}
        while pending or running:
            while pending and len(running) < args.jobs:
                seed = pending.pop(0)
                root = os.path.join(tmp, f"seed{seed}")
                running[start(seed, root, extra).pid] = (seed, root, time.monotonic())
            pid, status, usage = os.wait4(-1, 0)
            seed, root, began = running.pop(pid)
            if status != 0:
                sys.exit(f"seed {seed}: lit-trainer exited with status {os.waitstatus_to_exitcode(status)}")
            cpu = usage.ru_utime + usage.ru_stime
            results[seed] = (exact_match_history(root), time.monotonic() - began, cpu)
            print(f"seed {seed} done: {results[seed][0][-1][1]:.3f} ({results[seed][1]:.0f} s wall, {cpu:.0f} CPU-s)")
    steps = [s for s, _ in results[args.seeds[0]][0]]
    print("\n| seed | " + " | ".join(f"step {s}" for s in steps) + " | wall s | CPU s |")
    print("|---" * (len(steps) + 3) + "|")
    for seed in args.seeds:
        history, wall, cpu = results[seed]
        print(f"| {seed} | " + " | ".join(f"{v:.3f}" for _, v in history) + f" | {wall:.0f} | {cpu:.0f} |")
    last = [results[s][0][-1][1] for s in args.seeds]
    print(f"\nlast validation: median {statistics.median(last):.3f}, minimum {min(last):.3f}")


if __name__ == "__main__":
    main()
