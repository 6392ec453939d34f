"""Objects named by import path in a config (``"package.module.name"``): reward functions, tools, environments.

Only what the user's config or code names is imported (docs/design.md#nothing-unasked).
"""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str, what: str, hint: str) -> Any:
    """The object at ``path`` (``"package.module.name"``).

    Args:
        path: the dotted path.
        what: names the object in the message (e.g. ``"Tool"``).
        hint: what to give instead, appended to the message.

    Raises:
        ValueError: naming ``path`` and the import error, then ``hint``.
    """
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{what} {path!r} cannot be imported ({err}): {hint}") from err
