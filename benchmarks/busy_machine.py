"""The README main job beside busy processes: lit-trainer's OpenMP default vs one thread vs the old behaviour.

Runs ``lit-trainer fit --config configs/sft.yaml`` with a reduced ``--trainer.max_steps`` (each run in its own temp
folder; no validation runs before step 500, so a run is start-up + training + the last checkpoint + the HF export),
in separate processes, under these set-ups:

  new     the ``lit-trainer`` console script as installed: it sets ``GOMP_SPINCOUNT=10000`` before torch loads
          (waiting OpenMP threads spin briefly, then sleep) and keeps torch's default thread count;
  one     the same with ``OMP_NUM_THREADS=1`` (the former advice);
  old     the CLI without that entry (``lit_trainer.cli.main`` called directly): torch's default threads, libgomp's
          default spin-then-sleep waits (300,000 spins), as before;
  passive the same with ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep at once), the alternative considered.

Busy phase: ``--busy`` pure-Python spin loops (default 4 per core, so the load is about 5x the cores with the job's
own threads and whatever else runs) start first and stop by themselves after ``--busy-seconds`` (they are also
stopped when the benchmark ends); the set-ups run in turn, ``--repeats`` interleaved rounds, so load drifts hit all
alike. Quiet phase: the same without the spin loops, ``new`` vs ``old`` (the machine may still be shared; the
1-minute load average is printed with every run). Medians are compared; CPU seconds are the job's user + system
time (spinning waits show up there).

Usage: python benchmarks/busy_machine.py [--steps 200] [--repeats 2] [--busy 8] [--busy-seconds 1800]
       [--busy-variants new,one,old] [--quiet-variants new,old]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPENMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "MKL_NUM_THREADS")
OLD_ENTRY = "import sys; from lit_trainer.cli import main; sys.argv[0] = 'lit-trainer'; main()"
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@dataclass
class Run:
    wall: float
    cpu: float
    load: float


def command(variant: str, steps: int, root: str) -> tuple[list[str], dict[str, str]]:
    """The job's command line and environment for one set-up (OpenMP variables of the caller removed)."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    job = ["fit", "--config", "configs/sft.yaml", "--trainer.max_steps", str(steps), "--trainer.default_root_dir", root]
    script = str(Path(sys.executable).parent / "lit-trainer")
    if variant == "new":
        return [script, *job], env
    if variant == "one":
        return [script, *job], {**env, "OMP_NUM_THREADS": "1"}
    if variant == "old":
        return [sys.executable, "-c", OLD_ENTRY, *job], env
    if variant == "passive":
        return [sys.executable, "-c", OLD_ENTRY, *job], {**env, "OMP_WAIT_POLICY": "PASSIVE"}
    raise ValueError(f"unknown variant {variant!r}: use new, one, old or passive")


def run_job(variant: str, steps: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="busy_machine_") as root:
        argv, env = command(variant, steps, root)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{variant} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(wall, cpu, os.getloadavg()[0])


def start_spinners(count: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)]) for _ in range(count)]


def stop(spinners: list[subprocess.Popen]) -> None:
    for p in spinners:
        if p.poll() is None:
            p.terminate()
    for p in spinners:
        p.wait()


def phase(name: str, variants: list[str], steps: int, repeats: int) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {v: [] for v in variants}
    for r in range(repeats):
        for v in variants:
            runs[v].append(run_job(v, steps))
            x = runs[v][-1]
            print(f"  {name} round {r + 1} {v}: {x.wall:.1f} s wall, {x.cpu:.1f} s CPU, load {x.load:.1f}", flush=True)
    return runs


def table(name: str, runs: dict[str, list[Run]], reference: str) -> None:
    wall = {v: statistics.median(x.wall for x in rs) for v, rs in runs.items()}
    print(f"\n{name}: median of {len(next(iter(runs.values())))} interleaved rounds\n")
    print(f"| set-up | wall s, median | wall s, per round | CPU s, median | load (1 min) | wall / {reference} |")
    print("|---|---:|---|---:|---|---:|")
    for v, rs in runs.items():
        rounds = ", ".join(f"{x.wall:.1f}" for x in rs)
        loads = ", ".join(f"{x.load:.1f}" for x in rs)
        cpu = statistics.median(x.cpu for x in rs)
        print(f"| {v} | {wall[v]:.1f} | {rounds} | {cpu:.1f} | {loads} | {wall[v] / wall[reference]:.2f} |")


def main() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="--trainer.max_steps of each run")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds per phase")
    parser.add_argument("--busy", type=int, default=4 * cores, help="spin-loop processes in the busy phase")
    parser.add_argument("--busy-seconds", type=float, default=1800.0, help="the spin loops stop after this")
    parser.add_argument("--busy-variants", default="new,one,old")
    parser.add_argument("--quiet-variants", default="new,old", help="empty: no quiet phase")
    args = parser.parse_args()
    print(f"{cores} cores; load average before: {os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    if args.busy and args.busy_variants:
        spinners = start_spinners(args.busy, args.busy_seconds)
        try:
            time.sleep(5)
            results["busy"] = phase("busy", args.busy_variants.split(","), args.steps, args.repeats)
        finally:
            stop(spinners)
        if not all(p.returncode and p.returncode < 0 for p in spinners):
            print("note: the spin loops ended before the busy phase did; raise --busy-seconds", file=sys.stderr)
    if args.quiet_variants:
        # let the 1-minute load average fall (it lags a minute): `new` chooses its OpenMP waits from it at start
        deadline = time.monotonic() + 180
        while os.getloadavg()[0] > cores and time.monotonic() < deadline:
            time.sleep(5)
        results["quiet"] = phase("quiet", args.quiet_variants.split(","), args.steps, args.repeats)
    print(f"\nCommand: `python benchmarks/busy_machine.py {' '.join(sys.argv[1:])}`".rstrip())
    print(f"{cores} cores; lit-trainer fit --config configs/sft.yaml --trainer.max_steps {args.steps} per run.")
    if "busy" in results:
        reference = "one" if "one" in results["busy"] else next(iter(results["busy"]))
        table(f"Busy ({args.busy} spin-loop processes)", results["busy"], reference)
    if "quiet" in results:
        reference = "old" if "old" in results["quiet"] else next(iter(results["quiet"]))
        table("Quiet (no spin loops; other jobs may share the machine)", results["quiet"], reference)


if __name__ == "__main__":
    main()
