"""Command-line parsing that reads well: negative numbers as values, our message first, close-name suggestions."""

from __future__ import annotations

import re
from collections.abc import Sequence

from lightning.pytorch.cli import LightningArgumentParser

_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def join_negative_numbers(args: Sequence[str]) -> list[str]:
    """``["--x", "-1e-3"]`` -> ``["--x=-1e-3"]``: argparse takes ``-1e-3`` for an option, so ``--x -1e-3`` fails.

    Example:
        >>> join_negative_numbers(["fit", "--model.init_args.learning_rate", "-1e-3", "--trainer.max_steps", "5"])
        ['fit', '--model.init_args.learning_rate=-1e-3', '--trainer.max_steps', '5']
    """
    out: list[str] = []
    for arg in args:
        if out and _NEGATIVE_NUMBER.match(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


class FriendlyParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose errors lead with the actionable line."""
