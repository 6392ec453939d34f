"""The code in docs/customizing.md and CONTRIBUTING.md is the repository's code, so the guides cannot drift.

A block marked ``<!-- example: path -->`` must be the whole file; one marked ``<!-- excerpt: path -->`` must appear
in the file (compared without whitespace, trailing commas and split string literals, so reformatting the library
keeps it valid). Every Python or YAML block of the two guides must carry one of the marks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ("docs/customizing.md", "CONTRIBUTING.md")
EXAMPLES = sorted(p for p in (ROOT / "examples" / "customizing").glob("[!_]*") if p.suffix in (".py", ".yaml"))
_BLOCK = re.compile(r"(?:<!-- (example|excerpt): (\S+) -->\n)?```(\w*)\n(.*?)```", re.DOTALL)


def _blocks(guide: str) -> list[tuple[str | None, str | None, str, str]]:
    return _BLOCK.findall((ROOT / guide).read_text())


def _normalised(code: str) -> str:
    """Code without whitespace, trailing commas and breaks between implicitly concatenated strings."""
    code = re.sub(r"\s+", "", code)
    return re.sub(r",([)\]}])", r"\1", code).replace('""', "")


@pytest.mark.parametrize("guide", GUIDES)
def test_every_code_block_is_the_repository_code(guide):
    checked = 0
    for kind, path, language, code in _blocks(guide):
        if language not in ("python", "yaml"):  # shell lines and markdown illustrations are not repository code
            continue
        assert kind, f"{guide}: a {language} block without an example/excerpt mark:\n{code[:200]}"
        source = (ROOT / path).read_text()
        if kind == "example":
            assert code == source, f"{guide}: the block of {path} differs from the file: copy the file again"
        else:
            assert _normalised(code) in _normalised(source), f"{guide}: the excerpt is no longer in {path}"
        checked += 1
    assert checked >= 3


def test_every_example_file_is_shown_in_full():
    shown = {path for guide in GUIDES for kind, path, _, _ in _blocks(guide) if kind == "example"}
    assert shown == {str(p.relative_to(ROOT)) for p in EXAMPLES}


def test_the_check_catches_a_changed_line(tmp_path):
    code = (ROOT / "examples" / "customizing" / "dpop.py").read_text()
    changed = code.replace("torch.relu(-u_chosen)", "torch.relu(u_chosen)")
    assert changed != code and _normalised(changed) != _normalised(code)
    assert _normalised("f(a,\n  b,\n)") == _normalised("f(a, b)")


def test_examples_import_only_public_modules():
    """The examples are what a contributor copies: they must not teach imports of private (``_``) modules."""
    private = re.compile(r"^\s*(?:from|import)\s+(lit_trainer\S*\._\w+)", re.MULTILINE)
    found = {p.name: private.findall(p.read_text()) for p in EXAMPLES if p.suffix == ".py"}
    assert not {name: mods for name, mods in found.items() if mods}, found
