"""``lit-trainer --help`` against ``python -c "import torch"`` (the goal: no slower), and ``lit-trainer fit --help``.

Runs each command ``--repeats`` times, interleaved (so machine load hits all of them alike), as separate processes,
and prints the median wall time of each and the ratio to importing torch.

Usage: python benchmarks/cli_help.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    script = Path(sys.executable).with_name("lit-trainer")
    exe = str(script) if script.exists() else shutil.which("lit-trainer") or "lit-trainer"
    commands = {
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "lit-trainer --help": [exe, "--help"],
        "lit-trainer fit --help": [exe, "fit", "--help"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, command in commands.items():
            times[name].append(_seconds(command))
    torch_median = statistics.median(times['python -c "import torch"'])
    print(f"{'command':<28}{'median s':>10}{'vs import torch':>18}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<28}{median:>10.3f}{median / torch_median:>17.2f}x")


if __name__ == "__main__":
    main()
