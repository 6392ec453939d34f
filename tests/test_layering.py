"""The package's layers: which top-level parts of ``lit_trainer`` may import which (static: read with ``ast``).

A *part* is a top-level subpackage or module of ``lit_trainer`` (``callbacks``, ``core``, ``checkpoint_io``, ...);
``lit_trainer/__init__.py`` is the part ``lit_trainer``. :data:`ALLOWED` says which other parts each one may import
(docs/design.md#layers draws the same table). Two rules are checked over every import statement of every file,
wherever it is (module level, inside a function, under ``TYPE_CHECKING``), and over
``importlib.import_module("lit_trainer...")`` calls with a constant name:

* an import from one part into another must be an arrow of :data:`ALLOWED`;
* an import from one part into another never names a private (underscore) module or object: what a part shares is
  public inside the library (``lit_trainer.core.atomic``, not ``lit_trainer._atomic``).

And ``import lit_trainer.callbacks`` (and its ``pytorch_lightning`` flavour) loads only the parts that the table
lets the callbacks import: the callbacks work in any Lightning project without the modules, data or the CLI.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_trainer"

# part -> the other parts it may import. Lower layers first; a part not listed here fails the test (add it).
ALLOWED: dict[str, set[str]] = {
    "core": set(),  # the bottom: atomic writes, collectives, seeding, sharding, the Lightning namespaces, ...
    "losses": {"core"},  # pure tensor functions
    "quantization": {"core"},
    "run_exports": {"core"},
    "checkpoint_io": {"core"},
    "checkpoint_load": {"core"},
    "models": {"core", "quantization", "run_exports"},
    "metrics": {"core", "losses"},
    "data": {"core", "losses", "models"},
    "rewards": {"core", "data", "models"},
    # the rollout engines, generator and agentic rounds: no LightningModule; data for the prompt columns and padding
    "generation": {"core", "models", "data"},
    # usable in any Lightning project: never the modules, data, models, loggers or the CLI
    "callbacks": {"core", "checkpoint_io", "checkpoint_load", "quantization"},
    "loggers": {"core"},
    "modules": {
        "core",
        "losses",
        "data",
        "models",
        "metrics",
        "rewards",
        "generation",
        "quantization",
        "checkpoint_io",
        "checkpoint_load",
        "run_exports",
    },
    "lit_trainer": {"modules"},  # the package's lazy re-exports of the modules
    "cli": {
        "lit_trainer",
        "core",
        "losses",
        "quantization",
        "run_exports",
        "checkpoint_io",
        "checkpoint_load",
        "models",
        "metrics",
        "data",
        "rewards",
        "generation",
        "callbacks",
        "loggers",
        "modules",
    },
    "entry": {"cli"},  # `python -m lit_trainer.entry` and the config path `lit_trainer.runs.RunCSVLogger`
    "runs": {"cli"},
}


@dataclass(frozen=True)
class Import:
    """One name one module imports: ``from <target> import <name>`` (``name`` is None for ``import <target>``)."""

    importer: str
    line: int
    target: str
    name: str | None

    def __str__(self) -> str:
        what = self.target if self.name is None else f"{self.target}.{self.name}"
        return f"{self.importer} (line {self.line}) imports {what}"


def module_names(package: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``package`` (a package is its ``__init__.py``)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _import_module_name(node: ast.Call) -> str | None:
    """The constant module name of an ``importlib.import_module("...")`` / ``import_module("...")`` call."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called != "import_module" or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports_of(package: Path) -> list[Import]:
    """Every import of ``package``'s own modules, by every module of ``package``, relative imports resolved.

    ``from pkg import name`` imports the submodule ``pkg.name`` when there is one (``target`` is then the submodule
    and ``name`` None), else the object ``name`` of ``pkg``.
    """
    modules = module_names(package)
    root = package.name
    found = []
    for importer, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            pairs: list[tuple[str, str | None]] = []
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = importer.split(".") if is_package else importer.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    pairs.append((sub, None) if sub in modules else (base, alias.name))
            elif isinstance(node, ast.Call) and (name := _import_module_name(node)) is not None:
                pairs = [(name, None)]
            found += [
                Import(importer, node.lineno, target, name)
                for target, name in pairs
                if target == root or target.startswith(root + ".")
            ]
    return found


def part(module: str) -> str:
    """The top-level part of a dotted name: ``lit_trainer.callbacks.bema._shards`` -> ``callbacks``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(imports: list[Import], allowed: dict[str, set[str]]) -> list[str]:
    """What breaks the two rules (see the module docstring), one line each."""
    found = []
    for imp in imports:
        source, target = part(imp.importer), part(imp.target)
        if source == target:
            continue
        if source not in allowed:
            found.append(f"{imp}: part `{source}` has no row in the layer table; add one")
        elif target not in allowed[source]:
            found.append(f"{imp}: `{source}` may not import `{target}` (it may import {sorted(allowed[source])})")
        names = imp.target.split(".")[1:] + ([imp.name] if imp.name else [])
        private = [n for n in names if _private(n)]
        if private:
            found.append(f"{imp}: private name {private[0]!r} used outside its part `{target}`; make it public")
    return found


def test_lit_trainer_keeps_its_layers():
    problems = violations(imports_of(PACKAGE), ALLOWED)
    assert problems == [], "imports across the layers (docs/design.md#layers):\n" + "\n".join(problems)


def test_every_part_has_a_row_and_the_table_has_no_cycle():
    parts = {part(name) for name in module_names(PACKAGE)}
    assert parts == set(ALLOWED), (
        f"parts without a row: {parts - set(ALLOWED)}, rows without a part: {set(ALLOWED) - parts}"
    )
    order: list[str] = []  # a topological order exists only when no arrow points back up
    pending = dict(ALLOWED)
    while pending:
        ready = [p for p, deps in pending.items() if deps <= set(order)]
        assert ready, f"the layer table has a cycle among {sorted(pending)}"
        order += sorted(ready)
        for p in ready:
            del pending[p]


def test_the_check_finds_a_forbidden_arrow_and_a_private_name(tmp_path: Path):
    package = tmp_path / "lit_trainer"
    for folder in ("core", "callbacks", "modules", "modules/base"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "core" / "atomic.py").write_text("def commit(): ...\ndef _partial(): ...\n")
    (package / "modules" / "base" / "_sharding.py").write_text("def local(t): return t\n")
    (package / "modules" / "base" / "__init__.py").write_text("from . import _sharding\n")  # same part: fine
    (package / "callbacks" / "bema.py").write_text(
        "from lit_trainer.core.atomic import commit\n"  # allowed
        "def f():\n"
        "    from ..modules.base._sharding import local\n"  # forbidden arrow AND a private module, in a function
        "    from lit_trainer.core.atomic import _partial\n"  # allowed arrow, private name
    )
    (package / "core" / "late.py").write_text(
        "import importlib\nimportlib.import_module('lit_trainer.callbacks')\n"  # core imports nothing above it
    )
    table = {"lit_trainer": set(), "core": set(), "callbacks": {"core"}, "modules": {"core"}}
    problems = violations(imports_of(package), table)
    assert problems == [
        "lit_trainer.callbacks.bema (line 3) imports lit_trainer.modules.base._sharding.local: `callbacks` may not "
        "import `modules` (it may import ['core'])",
        "lit_trainer.callbacks.bema (line 3) imports lit_trainer.modules.base._sharding.local: private name "
        "'_sharding' used outside its part `modules`; make it public",
        "lit_trainer.callbacks.bema (line 4) imports lit_trainer.core.atomic._partial: private name '_partial' used "
        "outside its part `core`; make it public",
        "lit_trainer.core.late (line 2) imports lit_trainer.callbacks: `core` may not import `callbacks` (it may "
        "import [])",
    ]
    (package / "loggers.py").write_text("from lit_trainer.core.atomic import commit\n")
    assert violations(imports_of(package), table)[-1].endswith("part `loggers` has no row in the layer table; add one")


def _loaded_after(statement: str) -> dict[str, list[str]]:
    code = (
        "import json, sys\n"
        f"{statement}\n"
        "print(json.dumps({'lit_trainer': sorted(m for m in sys.modules if m.startswith('lit_trainer')),"
        " 'other': sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'trl', 'peft', 'datasets'))}))"
    )
    # a fresh interpreter that imports this checkout's lit_trainer
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"`{statement}` failed in a fresh interpreter:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    # the package imports every callback and `RunIdentity`, `resolve_resume`, `resolve_resume_checkpoint`; the second
    # builds the `pytorch_lightning` twins (the test extra installs `pytorch_lightning`)
    ["import lit_trainer.callbacks", "import lit_trainer.callbacks.pytorch_lightning"],
)
def test_the_callbacks_load_without_the_rest_of_the_library(statement: str):
    loaded = _loaded_after(statement)
    parts = {part(name) for name in loaded["lit_trainer"]}
    assert parts <= ALLOWED["callbacks"] | {"callbacks", "lit_trainer"}, (
        f"`{statement}` loaded {sorted(parts - ALLOWED['callbacks'] - {'callbacks', 'lit_trainer'})}"
    )
    assert "lit_trainer.modules" not in loaded["lit_trainer"] and "lit_trainer.cli" not in loaded["lit_trainer"]
    # no Hugging Face model classes, TRL, peft or datasets (Lightning itself imports transformers' utilities)
    heavy = [m for m in loaded["other"] if m == "transformers.modeling_utils" or m.split(".")[0] != "transformers"]
    assert heavy == [], f"`{statement}` loaded {heavy}"
