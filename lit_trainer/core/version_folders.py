"""Lightning's logger version folders: ``<root>/<name>/version_<n>``, or a named version's own folder.

Shared by the CLI (which reserves a run's version folder) and the loggers (``TrackioLogger`` names its run after
the same folder), so it lives in ``core``, below both.
"""

from __future__ import annotations

import re

_VERSION = re.compile(r"^version_(\d+)$")


def version_number(version: int | str | None) -> int | None:
    """``3`` for ``3``, ``"3"`` or ``"version_3"``; ``None`` for anything else."""
    if isinstance(version, int):
        return version
    if isinstance(version, str):
        match = _VERSION.match(version)
        if match or version.isdigit():
            return int(match.group(1) if match else version)
    return None


def version_folder(version: int | str) -> str:
    """The folder name of a logger version: ``version_<n>`` for a number (``3``, ``"3"``, ``"version_3"``), else the
    string itself.

    Example:
        >>> version_folder(3), version_folder("version_3"), version_folder("baseline")
        ('version_3', 'version_3', 'baseline')
    """
    number = version_number(version)
    return f"version_{number}" if number is not None else str(version)
