"""The ``lit-trainer`` console script's first stage: what must happen before torch and Lightning are imported.

**OpenMP waits.** torch's CPU kernels run on OpenMP threads (libgomp in the Linux PyPI wheels), and by default a
thread that reaches the end of a parallel region spins, waiting for the others, for up to 300,000 iterations before it
sleeps. When other processes keep the cores busy, the spinning thread burns the time slice that the thread it waits
for needs, and a training step of a small model can take many times longer. libgomp reads its environment once, when
torch loads it, so the command chooses how threads wait before that, from the 1-minute load average:

* cores busy (load above the cores available): ``OMP_WAIT_POLICY=PASSIVE``, waiting threads sleep at once;
* otherwise: ``GOMP_SPINCOUNT=10000``, a wait spins 30 times less long than libgomp's default, still long enough to
  catch the other threads on a quiet machine.

Measured with ``benchmarks/busy_machine.py`` (docs/benchmarks.md): on a quiet machine the short spin is as fast as
libgomp's default and passive waits 5-10% slower; at load 18-19 on 2 cores passive waits are as fast as one thread and
the short spin 1.5-1.9x slower; libgomp's default was 5.4x slower than one thread at load 10-13. Why the waits and not
the thread count: waiting changes when threads sleep, never how work is split, so results are bit-identical whatever
the load (a choice from the load is safe for exact resume); a thread count chosen from the current load could change
float reductions between the first part of a run and its resumed part. A variable the user set
(``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``) is kept as is, and ``import lit_trainer`` alone changes
nothing. Other OpenMP runtimes (LLVM's libomp on macOS) ignore ``GOMP_SPINCOUNT``.

**Help.** Importing Lightning and transformers takes seconds (tens of seconds on a busy machine), so ``lit-trainer``,
``lit-trainer -h`` and ``lit-trainer --help`` are answered here, from the recipe files alone, without them: what the
command does, the shipped recipes (``configs/*.yaml``) with the first sentence of each one's header, the commands a
user runs and where the docs are. Everything else goes on to :func:`lit_trainer.cli.main` (``lit-trainer fit
--help`` is LightningCLI's full option list). This module imports nothing heavy; ``lit_trainer/__init__`` loads its
modules lazily, so importing it does not import torch.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from lit_trainer import __version__

# Variables that already say how waiting OpenMP threads behave (libgomp, or Intel's OpenMP for KMP_BLOCKTIME).
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SHORT_SPIN = 10_000  # libgomp spin iterations before a waiting thread sleeps (its default: 300,000)


def openmp_defaults(environ: Mapping[str, str], load: float = 0.0, cores: int = 1) -> dict[str, str]:
    """The OpenMP variables the ``lit-trainer`` command sets: none when the user already chose how threads wait.

    Args:
        environ: the environment (a wait variable set there wins).
        load: the 1-minute load average when the command starts.
        cores: the cores this process may run on.

    Example:
        >>> openmp_defaults({}, load=0.3, cores=2)
        {'GOMP_SPINCOUNT': '10000'}
        >>> openmp_defaults({}, load=7.5, cores=2)
        {'OMP_WAIT_POLICY': 'PASSIVE'}
        >>> openmp_defaults({"OMP_WAIT_POLICY": "active"}, load=7.5, cores=2)
        {}
    """
    if any(environ.get(name) for name in WAIT_VARIABLES):
        return {}
    if load > cores:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": str(SHORT_SPIN)}


def _load_and_cores() -> tuple[float, int]:
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        load = 0.0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return load, cores


def apply_openmp_defaults(
    environ: MutableMapping[str, str] = os.environ, load: float | None = None, cores: int | None = None
) -> dict[str, str]:
    """Set :func:`openmp_defaults` in ``environ`` (before torch is imported) and return what was set; ``load`` and
    ``cores`` default to this machine's now."""
    measured_load, measured_cores = _load_and_cores()
    chosen = openmp_defaults(
        environ, measured_load if load is None else load, measured_cores if cores is None else cores
    )
    environ.update(chosen)
    return chosen


_CHECKOUT = Path(__file__).resolve().parents[1]  # the source tree (an editable install) holds configs/ and docs/
_SENTENCE_END = re.compile(r"(?<=[^.\s])(?:\.\s|:\s|\.$)")
_QUICK_HELP_ARGS = ([], ["-h"], ["--help"])


def recipe_summary(text: str) -> str:
    """The first sentence of a config's header comment (its leading ``#`` lines), or ``""``.

    Example:
        >>> recipe_summary("# GRPO on the built-in prompts (no download).\\n#   lit-trainer fit ...\\nseed: 1\\n")
        'GRPO on the built-in prompts (no download)'
        >>> recipe_summary("# DPO with LoRA adapters (peft): the reference is the same\\n# network.\\n")
        'DPO with LoRA adapters (peft)'
    """
    header: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#  "):  # the header ends at a command line or the YAML
            break
        header.append(line.lstrip("#").strip())
    joined = " ".join(header)
    match = _SENTENCE_END.search(joined)
    return joined[: match.start()] if match else joined


def recipes_folder(cwd: Path | None = None) -> Path | None:
    """``./configs`` when it holds recipes, else the source checkout's ``configs/``, else ``None``."""
    for folder in ((cwd or Path.cwd()) / "configs", _CHECKOUT / "configs"):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    return None


def quick_help(cwd: Path | None = None) -> str:
    """The text of ``lit-trainer --help``."""
    lines = [
        f"lit-trainer {__version__}: fine-tune and align language models (SFT, DPO, GRPO) with PyTorch Lightning.",
        "",
        "usage: lit-trainer {fit,validate,test,predict} --config CONFIG [--section.option VALUE ...]",
        "",
    ]
    folder = recipes_folder(cwd)
    if folder is not None:
        lines.append(f"Recipes ({folder}):")
        files = sorted(folder.glob("*.yaml"))
        width = max(len(p.name) for p in files) + 2
        lines += [f"  {p.name:<{width}}{recipe_summary(p.read_text(errors='replace'))}" for p in files]
        lines.append("")
    config = "configs/sft.yaml"
    commands = [
        (f"lit-trainer fit --config {config}", "train (the main job: built-in tiny model and data, no download)"),
        (f"lit-trainer fit --config {config} --ckpt_path last", "continue the newest unfinished run of this config"),
        (f"lit-trainer fit --config {config} --model.learning_rate 1e-3", "override any option"),
        (f"lit-trainer fit --config {config} --print_config", "the full configuration with every default"),
        ("lit-trainer fit --help", "trainer options, and how to list the model and data options"),
        ("lit-trainer validate --config CONFIG --ckpt_path PATH", "evaluate a checkpoint (also test, predict)"),
    ]
    lines.append("Commands:")
    for command, what in commands:
        lines += [f"  {command}", f"      {what}"]
    lines += [
        "",
        "A run writes runs/<run name>/version_<n>/: metrics.csv, config.yaml, checkpoints/ and hf_model/,",
        "a Hugging Face export that loads with transformers.AutoModelForCausalLM.from_pretrained.",
        "Ctrl-C or SIGTERM saves a checkpoint at the next optimizer step (the recipes' JITCheckpoint);",
        "--ckpt_path last continues from it.",
        "",
    ]
    docs = _CHECKOUT / "docs" / "index.md"
    if docs.is_file():
        lines.append(f"Docs: {docs} (Markdown), or as a site from the repository root:")
    else:
        lines.append("Docs: the repository's docs/ folder (Markdown), or as a site from the repository root:")
    lines.append('  pip install -e ".[docs]" && mkdocs serve')
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lit-trainer`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in _QUICK_HELP_ARGS:
        print(quick_help())
        return
    apply_openmp_defaults()
    from lit_trainer.cli import main as cli_main

    cli_main(None if argv is None else args)


if __name__ == "__main__":
    main()
