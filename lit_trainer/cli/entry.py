"""The ``lit-trainer`` console script's first stage: what must happen before torch and Lightning are imported.

**OpenMP waits** are chosen here from the load, before torch loads (:mod:`lit_trainer.cli.openmp`).

**Help.** Importing Lightning and transformers takes seconds (tens of seconds on a busy machine), so ``lit-trainer``,
``lit-trainer -h`` and ``lit-trainer --help`` are answered here, from the recipe files alone, without them: what the
command does, the shipped recipes (``configs/*.yaml``) with the first sentence of each one's header, the commands a
user runs and where the docs are. Everything else goes on to :func:`lit_trainer.cli.main` (``lit-trainer fit
--help`` is LightningCLI's full option list). This module imports nothing heavy; ``lit_trainer/__init__`` loads its
modules lazily, so importing it does not import torch.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

from lit_trainer import __version__
from lit_trainer.cli.openmp import apply_openmp_defaults

_CHECKOUT = Path(__file__).resolve().parents[2]  # the source tree (an editable install) holds configs/ and docs/
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
        (f"lit-trainer fit --config {config} --report_to trackio", "also log to Trackio (or tensorboard, wandb, ...)"),
        (f"lit-trainer fit --config {config} --print_config", "the full configuration with every default"),
        ("lit-trainer fit --help", "trainer options, and how to list the model and data options"),
        ("lit-trainer validate --config CONFIG --ckpt_path PATH", "evaluate a checkpoint (also test, predict)"),
    ]
    lines.append("Commands:")
    for command, what in commands:
        lines += [f"  {command}", f"      {what}"]
    lines += [
        "",
        "A run writes runs/<run name>/version_<n>/: metrics.csv, curves.png, config.yaml, checkpoints/ and hf_model/,",
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
    from lit_trainer.cli.noise import quiet_hub_kernel_failures

    quiet_hub_kernel_failures()  # before the app imports transformers (which imports bitsandbytes)
    from lit_trainer.cli.app import main as cli_main

    cli_main(None if argv is None else args)


if __name__ == "__main__":
    main()
