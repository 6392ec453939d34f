"""Every measured accuracy figure of the README and the docs pages names the command that reproduces it.

The convention (CONTRIBUTING.md, "Figures in the docs"): a section (the text between two headings) that quotes a
measured figure carries, anywhere in it, at least one marker ``<!-- figures: COMMAND -->`` (an HTML comment: the site
and GitHub do not show it) naming the command that measured it, e.g. ``python benchmarks/methods_table.py --seeds 1 2
3`` or ``lit-trainer fit --config configs/sft.yaml``. A measured figure, for this check, is what a section
that speaks of "exact match", "accuracy" or "correct" answers quotes as a percentage with a decimal (``70.6%``) or a
three-decimal fraction (``0.956``), outside code blocks (a table's figures often sit apart from the sentence that says
what they measure).

Each marker's command must still run: ``python <script>`` names an existing file whose argparse options include
every ``--flag`` the marker passes (flags after ``--`` go to the runs a script starts and are checked as
lit-trainer's); ``lit-trainer <fit|validate> --config <file>`` names an existing config, and each ``--trainer.X``,
``--model.init_args.X`` and ``--data.init_args.X`` is an argument of ``lightning.Trainer`` or of the config's class.
The check is static (no training, no CLI start-up): the scripts' options are read from their source.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
from functools import cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_HEADING = re.compile(r"^#{1,6} .*$", re.MULTILINE)
_MARKER = re.compile(r"<!-- figures: (.+?) -->", re.DOTALL)
_FIGURE = re.compile(r"(?<![\d.])(?:\d{1,3}\.\d+%|[01]\.\d{3}(?!\d|\.\d))")  # a sentence's full stop may follow
_MEASURE = re.compile(r"exact[ _]match|accurac|correct", re.IGNORECASE)  # also the metric's name
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# lit-trainer's own top-level options (lit_trainer/cli/app.py) and LightningCLI's
_CLI_OPTIONS = {"--config", "--seed_everything", "--run_name", "--report_to", "--ckpt_path", "--print_config"}


def sections(text: str) -> list[tuple[str, str]]:
    """``(heading, body)`` of each section of a markdown text, fenced code blocks included in the body."""
    starts = [(m.start(), m.group(0)) for m in _HEADING.finditer(_FENCE.sub(lambda m: " " * len(m.group(0)), text))]
    bounds = [(0, "(top of the page)"), *starts, (len(text), "")]
    return [(bounds[i][1], text[bounds[i][0] : bounds[i + 1][0]]) for i in range(len(bounds) - 1)]


def unmarked_figures(text: str) -> list[tuple[str, str]]:
    """``(heading, figure)`` for each section that quotes a measured figure and has no ``figures:`` marker."""
    missing = []
    for heading, body in sections(text):
        prose = _FENCE.sub("", body)  # a marker or a figure in a code block does not count
        figure = _FIGURE.search(prose)
        if figure and _MEASURE.search(prose) and not _MARKER.search(prose):
            missing.append((heading.strip(), figure.group(0)))
    return missing


def markers(text: str) -> list[str]:
    return [" ".join(m.group(1).split()) for m in _MARKER.finditer(_FENCE.sub("", text))]


@cache
def script_options(path: Path) -> frozenset[str]:
    """The ``--options`` a script declares with ``add_argument`` (read from its source)."""
    options = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            options |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return frozenset(options | {"--help"})


def init_args(class_path: str) -> set[str]:
    """The argument names of a class's ``__init__``, following ``**kwargs`` up the class's bases."""
    module, name = class_path.rsplit(".", 1)
    names: set[str] = set()
    for cls in getattr(importlib.import_module(module), name).__mro__:
        if "__init__" not in vars(cls):
            continue
        params = inspect.signature(cls.__init__).parameters
        names |= set(params) - {"self", "args", "kwargs"}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names


def lit_trainer_problems(args: list[str]) -> list[str]:
    """What is wrong with ``lit-trainer ARGS`` (``fit|validate --config FILE --group.key value ...``)."""
    if not args or args[0] not in ("fit", "validate", "test"):
        return [f"lit-trainer subcommand {args[:1]} is not fit, validate or test"]
    flags = [a.split("=", 1)[0] for a in args[1:] if a.startswith("--")]
    configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    problems = [f"config {c} does not exist" for c in configs if not (ROOT / c).is_file()]
    if problems or not configs:
        return problems or ["no --config"]
    config = yaml.safe_load((ROOT / configs[0]).read_text())
    allowed = set(_CLI_OPTIONS) | {f"--trainer.{n}" for n in inspect.signature(pl.Trainer.__init__).parameters}
    for group in ("model", "data"):
        if isinstance(config.get(group), dict) and "class_path" in config[group]:
            allowed |= {f"--{group}.init_args.{n}" for n in init_args(config[group]["class_path"])}
    return [f"{configs[0]}: unknown option {f}" for f in flags if f not in allowed]


def command_problems(command: str) -> list[str]:
    """What is wrong with a marker's command (empty when it names existing files and known options)."""
    words = shlex.split(command)
    while words and _ENV.match(words[0]):
        words.pop(0)
    if words[:1] == ["lit-trainer"]:
        return lit_trainer_problems(words[1:])
    if words[:1] != ["python"] or len(words) < 2:
        return [f"{command!r}: a marker's command starts with `python <script>` or `lit-trainer`"]
    if words[1:3] == ["-m", "pytest"]:
        return [
            f"{p} does not exist" for p in words[3:] if not p.startswith("-") and not (ROOT / p.split("::")[0]).exists()
        ]
    script = ROOT / words[1]
    if not script.is_file():
        return [f"script {words[1]} does not exist"]
    own, _, passed_on = " ".join(words[2:]).partition(" -- ")
    unknown = [f"{words[1]}: unknown option {f}" for f in shlex.split(own) if f.startswith("--") and f.split("=")[0]
               not in script_options(script)]  # fmt: skip
    relayed = shlex.split(passed_on)
    if relayed and "--config" not in relayed:
        relayed = ["fit", "--config", "configs/sft.yaml", *relayed]  # sft_seeds.py's runs
    return unknown + (lit_trainer_problems(relayed) if relayed else [])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_measured_figure_has_its_command(page: Path) -> None:
    missing = unmarked_figures(page.read_text())
    assert not missing, (
        f"{page.relative_to(ROOT)}: sections quoting a measured figure without a `<!-- figures: COMMAND -->` marker "
        f"(CONTRIBUTING.md, 'Figures in the docs'): {missing}"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_marker_command_still_runs(page: Path) -> None:
    problems = [p for command in markers(page.read_text()) for p in command_problems(command)]
    assert not problems, f"{page.relative_to(ROOT)}: {problems}"


def test_the_check_sees_a_figure_without_its_command() -> None:
    text = "# Page\n\nIntro.\n\n## Measured\n\nORPO reached 91.0% exact match.\n\n## Other\n\n14% of the parameters.\n"
    assert unmarked_figures(text) == [("## Measured", "91.0%")]
    marked = text.replace("## Other", "<!-- figures: python benchmarks/methods_table.py -->\n\n## Other")
    assert unmarked_figures(marked) == []
    in_code = "## Code\n\n```\nexact match 0.956\n```\n"
    assert unmarked_figures(in_code) == []
    marker_in_code = (
        "## Measured\n\n0.956 exact match.\n\n```\n<!-- figures: python benchmarks/lora_adapt.py -->\n```\n"
    )
    assert unmarked_figures(marker_in_code) == [("## Measured", "0.956")]
    metric_name = "## Export\n\nIt answers 478 of 500, the run's `val_exact_match` of 95.6%.\n"
    assert unmarked_figures(metric_name) == [("## Export", "95.6%")]


def test_the_check_sees_a_stale_command() -> None:
    assert command_problems("OMP_NUM_THREADS=1 python benchmarks/methods_table.py --seeds 1 2 3") == []
    assert command_problems("python benchmarks/methods_table.py --seed 1") == [
        "benchmarks/methods_table.py: unknown option --seed"
    ]
    assert command_problems("python benchmarks/no_such.py") == ["script benchmarks/no_such.py does not exist"]
    assert command_problems("lit-trainer fit --config configs/orpo.yaml --model.init_args.cpo_alpha 0") == [
        "configs/orpo.yaml: unknown option --model.init_args.cpo_alpha"
    ]
    assert command_problems("lit-trainer fit --config configs/simpo.yaml --model.init_args.cpo_alpha 0") == []
    assert command_problems("lit-trainer fit --config configs/sft.yaml --trainer.max_step 300") == [
        "configs/sft.yaml: unknown option --trainer.max_step"
    ]
