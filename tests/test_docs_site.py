"""The documentation site (mkdocs.yml, docs/) and the README's links into it, checked without mkdocs.

CI also runs ``mkdocs build --strict``; these checks are the cheap part of it that every test run repeats: every
page of the nav exists and every page is in the nav, every relative link of the README and of the docs pages reaches
an existing file and, for a ``#anchor``, a heading or ``<a id>`` of that file (the same slug on GitHub and on the
site), the ``docs/<page>.md#anchor`` references in code comments and docstrings resolve, every public name has an
API reference entry, the code blocks of the pages are valid code whose ``lit_trainer`` names exist, and the files and
pip extras that their shell commands name exist. (``tests/test_docs_snippets.py`` runs the Python blocks.)
"""

from __future__ import annotations

import ast
import importlib
import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = {"contributing.md"}  # made from CONTRIBUTING.md by mkdocs_hooks.py
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
# The public names that must have an API reference entry: (module, names), from the packages' __all__.
PUBLIC_MODULES = (
    "lit_trainer",
    "lit_trainer.data",
    "lit_trainer.callbacks",
    "lit_trainer.loggers",
    "lit_trainer.losses",
)
PUBLIC_SAMPLERS = ("LengthGroupedSampler", "LengthGroupedBatchSampler")  # lit_trainer.data.samplers

_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.MULTILINE)
_HTML_ID = re.compile(r"<a id=\"([^\"]+)\"></a>")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE_REF = re.compile(r"docs/([\w/]+\.md)(#[\w-]+)?")


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _without_code(markdown: str) -> str:
    return _FENCE.sub("", markdown)


def _heading_text(heading: str) -> str:
    """The heading as rendered: code marks dropped, link text kept."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")


def _github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", _heading_text(heading).lower()).replace(" ", "-")


def _mkdocs_slug(heading: str) -> str:
    """Python-Markdown's ``toc.slugify`` (MkDocs' default)."""
    text = unicodedata.normalize("NFKD", _heading_text(heading)).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@cache
def _anchors(path: Path) -> frozenset[str]:
    """Anchors that resolve the same on GitHub and on the site: headings whose two slugs agree, and ``<a id>``s."""
    text = path.read_text(encoding="utf-8")
    headings = _HEADING.findall(_without_code(text))
    same = {_github_slug(h) for h in headings} & {_mkdocs_slug(h) for h in headings}
    return frozenset(same | set(_HTML_ID.findall(text)))


def _broken_links(source: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(_without_code(source.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if path == "../CONTRIBUTING.md" and source.parent == DOCS:
            file = ROOT / "CONTRIBUTING.md"  # the site's contributing.md (mkdocs_hooks.py)
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading or <a id> with the anchor #{anchor} in {file.name}")
    return broken


def _config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = _nav_pages(_config()["nav"])
    missing = [p for p in nav if p not in GENERATED and not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml nav names pages that do not exist in docs/: {missing}"
    assert not set(PAGES) - set(nav), f"pages missing from the mkdocs.yml nav: {sorted(set(PAGES) - set(nav))}"
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"


def test_readme_links_reach_existing_files_and_anchors():
    readme = ROOT / "README.md"
    assert not _broken_links(readme), _broken_links(readme)
    into_docs = [t for t in _LINK.findall(_without_code(readme.read_text())) if t.startswith("docs/")]
    assert len({t.partition("#")[0] for t in into_docs}) >= 12, "the README should link into the docs pages"


@pytest.mark.parametrize("page", [*PAGES, "../CONTRIBUTING.md"])
def test_links_of_each_docs_page_reach_existing_files_and_anchors(page):
    broken = _broken_links((DOCS / page).resolve())
    assert not broken, f"{page}: {broken}"


def test_the_check_catches_a_missing_anchor_and_a_missing_file(tmp_path):
    (tmp_path / "a.md").write_text('# Packing (`packing=`)\n\n<a id="raw"></a>\n```\n# not a heading\n```\n')
    (tmp_path / "b.md").write_text("[ok](a.md#packing-packing) [ok](a.md#raw) [bad](a.md#not-a-heading) [bad](c.md)")
    assert [b.split(":")[0] for b in _broken_links(tmp_path / "b.md")] == ["a.md#not-a-heading", "c.md"]
    assert _github_slug("A -> B") != _mkdocs_slug("A -> B")  # such a heading is no anchor for a link


def test_docs_references_in_code_resolve():
    """``docs/<page>.md#anchor`` in docstrings, comments, configs and notebooks names an existing page and anchor."""
    sources = [p for d in ("lit_trainer", "tests", "examples", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    sources += [*(ROOT / "configs").glob("*.yaml"), *(ROOT / "notebooks").glob("*.ipynb"), ROOT / "CONTRIBUTING.md"]
    broken = []
    for source in sources:
        for page, anchor in _CODE_REF.findall(source.read_text(encoding="utf-8")):
            if not (DOCS / page).is_file() or (anchor and anchor[1:] not in _anchors(DOCS / page)):
                broken.append(f"{source.relative_to(ROOT)}: docs/{page}{anchor}")
    assert not broken, broken


def _api_entries() -> set[str]:
    return {m for p in (DOCS / "api").glob("*.md") for m in re.findall(r"^::: (\S+)$", p.read_text(), re.MULTILINE)}


def test_every_public_name_has_an_api_reference_entry():
    documented = {entry.rsplit(".", 1)[-1] for entry in _api_entries()}
    public = {name for module in PUBLIC_MODULES for name in importlib.import_module(module).__all__}
    missing = sorted((public | set(PUBLIC_SAMPLERS)) - documented)
    assert not missing, f"public names without a `::: ...` entry in docs/api/: {missing}"


def test_every_api_reference_entry_is_importable():
    for entry in sorted(_api_entries()):
        module, _, name = entry.rpartition(".")
        assert hasattr(importlib.import_module(module), name), entry


def _code_blocks(language: str) -> list[tuple[str, str]]:
    fence = re.compile(rf"^```{language}\n(.*?)^```", re.DOTALL | re.MULTILINE)
    return [(page, code) for page in PAGES for code in fence.findall((DOCS / page).read_text(encoding="utf-8"))]


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_python_blocks_are_valid_and_their_lit_trainer_imports_exist():
    blocks = _code_blocks("python")
    assert len(blocks) >= 10
    for page, code in blocks:
        tree = ast.parse(code, filename=page)  # a SyntaxError names the page
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lit_trainer"):
                for alias in node.names:
                    assert hasattr(importlib.import_module(node.module), alias.name), f"{page}: {alias.name}"


_SHELL_FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
# a repository file named literally (a `$algo` or `<recipe>` placeholder is no path to check)
_REPO_PATH = re.compile(r"(?<![\w./$<{-])((?:configs|benchmarks|examples|tests|notebooks)/[\w./-]*\w)")
_EXTRAS = re.compile(r"pip install (?:-e )?[\"']?(?:\.|lit_trainer)\[([\w,-]+)\]")


def _commands(markdown: str) -> list[str]:
    """The shell blocks of a page and the inline code of its prose (`python benchmarks/x.py`)."""
    return _SHELL_FENCE.findall(markdown) + _INLINE_CODE.findall(_without_code(markdown))


def _missing_paths_and_extras(markdown: str) -> list[str]:
    extras = set(_pyproject()["project"]["optional-dependencies"])
    missing = []
    for command in _commands(markdown):
        missing += [f"no file {path}" for path in _REPO_PATH.findall(command) if not (ROOT / path).exists()]
        for names in _EXTRAS.findall(command):
            missing += [f"no extra [{name}] in pyproject.toml" for name in names.split(",") if name not in extras]
    return missing


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_shell_commands_name_files_and_extras_that_exist():
    """The configs, scripts and tests that shell blocks and inline commands name exist, and so do the pip extras."""
    sources = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(DOCS / page for page in PAGES)]
    missing = {s.name: m for s in sources if (m := _missing_paths_and_extras(s.read_text(encoding="utf-8")))}
    assert not missing, missing
    named = {p for s in sources for c in _commands(s.read_text(encoding="utf-8")) for p in _REPO_PATH.findall(c)}
    assert len(named) >= 30, f"only {len(named)} paths found: the scan missed the pages' commands"


def test_the_shell_check_catches_a_missing_config_script_and_extra():
    page = (
        "```bash\nlit-trainer fit --config configs/sft.yaml\nlit-trainer fit --config configs/nope.yaml\n"
        'for a in rloo grpo; do lit-trainer fit --config configs/$a.yaml; done\npip install -e ".[peft,nope]"\n```\n'
        "Run `python benchmarks/missing.py` or `python benchmarks/sampling.py`."
    )
    assert _missing_paths_and_extras(page) == [
        "no file configs/nope.yaml",
        "no extra [nope] in pyproject.toml",
        "no file benchmarks/missing.py",
    ]


def test_yaml_blocks_parse_and_their_lit_trainer_class_paths_exist():
    blocks = _code_blocks("yaml")
    assert len(blocks) >= 3
    for page, code in blocks:
        yaml.safe_load(code)
        for class_path in re.findall(r"class_path: (lit_trainer\.[\w.]+)", code):
            assert isinstance(_resolve(class_path), type), f"{page}: {class_path}"
