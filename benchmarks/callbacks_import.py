"""What ``import lit_trainer.callbacks`` costs next to ``import lightning.pytorch``: wall time and modules loaded.

The callbacks are meant for any Lightning project, so importing them should cost little more than Lightning itself
(docs/design.md#layers). Runs each import ``--repeats`` times, interleaved (so machine load hits all of them alike),
each in a fresh process, and prints the median wall time, the ratio to Lightning's, and how many ``lit_trainer``
modules and modules in all the import loaded.

Usage: python benchmarks/callbacks_import.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

IMPORTS = ("lightning.pytorch", "lit_trainer.callbacks", "lit_trainer.callbacks.pytorch_lightning")
_PROBE = (
    "import importlib, json, sys, time\n"
    "start = time.perf_counter()\n"
    "importlib.import_module(sys.argv[1])\n"
    "seconds = time.perf_counter() - start\n"
    "print(json.dumps([seconds, sum(m.startswith('lit_trainer') for m in sys.modules), len(sys.modules)]))"
)


def _measure(module: str) -> tuple[float, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, module], check=True, capture_output=True, text=True).stdout
    seconds, ours, total = json.loads(out.splitlines()[-1])
    return seconds, ours, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in IMPORTS}
    counts: dict[str, tuple[int, int]] = {}
    for _ in range(args.repeats):
        for name in IMPORTS:
            seconds, ours, total = _measure(name)
            times[name].append(seconds)
            counts[name] = (ours, total)
    base = statistics.median(times["lightning.pytorch"])
    print(f"{'import':<42}{'median s':>10}{'vs Lightning':>14}{'lit_trainer':>13}{'all modules':>13}")
    for name in IMPORTS:
        median = statistics.median(times[name])
        print(f"{name:<42}{median:>10.2f}{median / base:>13.2f}x{counts[name][0]:>13}{counts[name][1]:>13}")


if __name__ == "__main__":
    main()
