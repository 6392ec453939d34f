"""The preference and RL methods side by side, at several seeds: the table of docs/methods.md.

For each seed S: the start is the main job as shipped (``lit-trainer fit --config configs/sft.yaml --seed_everything
S``, 2,000 steps; its greedy exact match is in one regime at every seed measured, docs/quickstart.md#at-every-seed);
each method's shipped recipe then trains from that export (``--model.init_args.model <start> --seed_everything S
--data.init_args.seed S``: the data modules shuffle with their own ``seed``, so ``--seed_everything`` alone would
repeat a pair method's run exactly at every seed), and the SFT module's validation (``lit-trainer validate --config
configs/sft.yaml``) measures greedy exact match on the 500 held-out problems of the start and of every method's
export. ``--start-seed N``: every method starts from the main job at seed N (one start run instead of one per seed).
Every run is its own process, one at a time, under ``--workdir`` (a temp folder by default; with a folder, a run
already there is reused, so ``--methods`` can add rows later). Prints one line per run, then the table: each seed and
minimum / median / maximum per run, with the CPU model and the CPU seconds of the fits.

Results move with the CPU and the thread count (rounding changes which step a run learns at): the point of several
seeds is to give the spread. Run at one thread (``OMP_NUM_THREADS=1``) to compare with the published table.

Usage: python benchmarks/methods_table.py [--seeds 1 2 3] [--start-seed 1] [--methods rpo orpo ...] [--max-steps N]
                                         [--workdir DIR]
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
# name -> (config, extra arguments): each shipped recipe, as a user runs it from the start's export
METHODS: dict[str, tuple[str, list[str]]] = {
    "sft": ("configs/sft.yaml", ["--trainer.max_steps", "300"]),  # continued SFT (300 steps of the recipe)
    "rpo": ("configs/dpo.yaml", []),  # sigmoid DPO + the SFT term, frozen reference
    "orpo": ("configs/orpo.yaml", []),
    "cpo_simpo": ("configs/simpo.yaml", []),  # shipped: cpo_alpha 1
    "simpo_pure": ("configs/simpo.yaml", ["--model.init_args.cpo_alpha", "0.0"]),
    "kto": ("configs/kto.yaml", []),
    "grpo": ("configs/grpo.yaml", []),
    "rloo": ("configs/rloo.yaml", []),
}


def lit_trainer(*args: str) -> float:
    """Run ``lit-trainer ARGS`` from the repository root; the CPU seconds it used (exits on a failed run)."""
    script = str(Path(sys.executable).parent / "lit-trainer")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([script, *args, "--trainer.enable_progress_bar", "false"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            log.seek(0)
            code = os.waitstatus_to_exitcode(status)
            sys.exit(f"lit-trainer {' '.join(args)} exited with status {code}:\n{log.read()[-3000:]}")
    return usage.ru_utime + usage.ru_stime


def exact_match(export: Path, root: Path) -> float:
    """Greedy exact match of ``export`` on the 500 held-out problems (the SFT module's validation)."""
    lit_trainer("validate", "--config", "configs/sft.yaml", "--model.init_args.model", str(export),
                "--trainer.default_root_dir", str(root), "--run_name", "eval")  # fmt: skip
    (path,) = root.rglob("metrics.csv")
    with open(path) as f:
        return float([r for r in csv.DictReader(f) if r.get("val_exact_match")][-1]["val_exact_match"])


def export_of(root: Path, run: str) -> Path:
    return root / run / "version_0" / "hf_model"


def measure(seed: int, method: str, workdir: Path, start_seed: int | None, steps: list[str]) -> tuple[float, float]:
    """``(exact match, CPU seconds of the fit)`` of one run (``method`` "start": the main job). A run whose export is
    already under ``workdir`` is not run again (its CPU seconds are then nan)."""
    start_root = workdir / f"start{seed if start_seed is None else start_seed}"
    root = start_root if method == "start" else workdir / f"seed{seed}"
    run = "sft" if method == "start" else method
    cpu = float("nan")
    if not export_of(root, run).is_dir():
        if method == "start":
            cpu = lit_trainer("fit", "--config", "configs/sft.yaml", "--seed_everything", str(start_seed or seed),
                              "--trainer.default_root_dir", str(root), "--run_name", "sft")  # fmt: skip
        else:
            config, extra = METHODS[method]
            cpu = lit_trainer("fit", "--config", config, "--model.init_args.model", str(export_of(start_root, "sft")),
                              "--seed_everything", str(seed), "--data.init_args.seed", str(seed),
                              "--trainer.default_root_dir", str(root),
                              "--run_name", method, *extra, *steps)  # fmt: skip
    evaluation = workdir / f"eval_{root.name}_{run}"
    shutil.rmtree(evaluation, ignore_errors=True)
    return exact_match(export_of(root, run), evaluation), cpu


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--workdir", type=Path, help="keep the runs here (a run already there is reused)")
    parser.add_argument(
        "--start-seed", type=int, help="every method starts from the main job at this seed (default: at its own seed)"
    )
    parser.add_argument("--max-steps", type=int, help="every method's --trainer.max_steps (default: its recipe's)")
    args = parser.parse_args()
    steps = [] if args.max_steps is None else ["--trainer.max_steps", str(args.max_steps)]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        results: dict[str, dict[int, tuple[float, float]]] = {}
        for method in ["start", *args.methods]:  # method by method: a stopped run still has whole rows
            for seed in args.seeds:
                if method == "start" and args.start_seed is not None and seed != args.seeds[0]:
                    results["start"][seed] = results["start"][args.seeds[0]]
                    continue
                results.setdefault(method, {})[seed] = measure(seed, method, workdir, args.start_seed, steps)
                em, cpu = results[method][seed]
                print(f"seed {seed} {method}: exact match {em:.3f} ({cpu:.0f} CPU-s)", flush=True)
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    start = "its own seed" if args.start_seed is None else f"seed {args.start_seed}"
    print(f"\nCommand: python benchmarks/methods_table.py {' '.join(sys.argv[1:])}")
    seeds = " ".join(map(str, args.seeds))
    print(f"\n{cpu_model()}, OMP_NUM_THREADS={threads}, seeds {seeds}, start: the main job at {start}")
    print("| run | exact match per seed | min / median / max | CPU s (median) |")
    print("|---|---|---|---|")
    for method, by_seed in results.items():
        ems = [by_seed[s][0] for s in args.seeds]
        cpus = [by_seed[s][1] for s in args.seeds if by_seed[s][1] == by_seed[s][1]] or [float("nan")]  # not reused
        per_seed = ", ".join(f"{e:.3f}" for e in ems)
        print(f"| {method} | {per_seed} | {spread(ems)} | {statistics.median(cpus):.0f} |")


if __name__ == "__main__":
    main()
