"""Each module class declares its run name once (``RUN_NAME``); the CLI's run folder, ``lit-trainer fit --help`` and
the methods table in the docs read it, so a new module cannot be missing from any of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lit_trainer
from lit_trainer.cli.app import fit_description
from lit_trainer.cli.runs import default_run_name
from lit_trainer.modules.dpo import DPOModule

METHODS_TABLE = Path(__file__).resolve().parents[1] / "docs" / "methods.md"


class MyDPO(DPOModule):
    """A user's subclass that declares no run name of its own."""


class Named(DPOModule):
    RUN_NAME = "my_recipe"


def _declared(name: str) -> str:
    return vars(getattr(lit_trainer, name))["RUN_NAME"]  # KeyError: the class inherits its name instead of declaring it


@pytest.mark.parametrize("name", lit_trainer.__all__)
def test_each_module_declares_its_run_name_and_the_cli_uses_it(name):
    assert re.fullmatch(r"[a-z][a-z0-9_]*", _declared(name))
    assert default_run_name(f"lit_trainer.{name}") == _declared(name)
    assert default_run_name(f"lit_trainer.modules.{name}") == _declared(name)


def test_run_names_are_distinct():
    names = [_declared(name) for name in lit_trainer.__all__]
    assert len(set(names)) == len(names), names


def test_a_subclass_gets_its_own_folder_unless_it_declares_one():
    # an inherited RUN_NAME would put a user's variant into the runs of the class it extends (and `last` would resume
    # the other's checkpoints), so only the class's own declaration counts
    assert default_run_name(f"{__name__}.MyDPO") == "mydpo"
    assert default_run_name(f"{__name__}.Named") == "my_recipe"
    assert default_run_name("my.pkg.NotImportable") == "notimportable"


def test_fit_help_lists_every_module_with_its_run_folder():
    text = fit_description()
    for name in lit_trainer.__all__:
        assert f"{name} (runs/{_declared(name)})" in text
    assert "{modules}" not in text


def test_the_methods_table_gives_each_modules_run_folder():
    rows = [line for line in METHODS_TABLE.read_text().splitlines() if line.startswith("| ")]
    for name in lit_trainer.__all__:
        row = next((r for r in rows if f"`{name}`" in r), None)
        assert row is not None, f"docs/methods.md's table has no row for {name}"
        assert f"`runs/{_declared(name)}/`" in row, row
