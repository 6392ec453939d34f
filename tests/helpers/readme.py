"""Run the README's "generate from the export" example exactly as written, on a given export and prompt."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_EXPORT_PATH = re.compile(r'"[^"]*hf_model"')
_EXAMPLE_PROMPT = '"12+34="'


def readme_generate_example() -> str:
    """The README's python block that calls ``model.generate`` (there must be exactly one)."""
    blocks = [b for b in _BLOCK.findall(README.read_text()) if "model.generate(" in b]
    assert len(blocks) == 1, f"expected one README python block calling model.generate, found {len(blocks)}"
    assert _EXAMPLE_PROMPT in blocks[0] and _EXPORT_PATH.search(blocks[0]), blocks[0]
    return blocks[0]


def run_readme_generate(export: str, prompt: str) -> str:
    """Execute the README block with its export path and prompt replaced; return what it printed (stripped)."""
    code = _EXPORT_PATH.sub(lambda _: json.dumps(export), readme_generate_example())
    code = code.replace(_EXAMPLE_PROMPT, f'"{prompt}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    return out.getvalue().strip()
