"""MkDocs hooks (mkdocs.yml `hooks:`): CONTRIBUTING.md, at the repository root, becomes the site's `contributing.md`.

The guide stays where GitHub shows it; its links into ``docs/`` are made relative to the site, and the docs pages'
links to ``../CONTRIBUTING.md`` point at the generated page, so both views have working links.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_ROOT = Path(__file__).resolve().parent
_TO_CONTRIBUTING = re.compile(r"\]\(\.\./CONTRIBUTING\.md")
_INTO_DOCS = re.compile(r"\]\(docs/")


def on_files(files: Files, config: Any) -> Files:
    text = (_ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "contributing.md", content=_INTO_DOCS.sub("](", text)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return _TO_CONTRIBUTING.sub("](contributing.md", markdown)
