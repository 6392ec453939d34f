"""Read a Lightning checkpoint safely even when its hyperparameters hold objects ``weights_only`` refuses.

Callbacks that read checkpoints back (``BestCheckpoint`` for its best weights, BEMA for its state, the CLI for a
run's record) need the tensors and the primitives, never the module's hyperparameters. ``torch.load(...,
weights_only=True)`` refuses a whole file for one ``pathlib.Path``, class or ``functools.partial`` among the
hyperparameters, which projects configured with hydra or jsonargparse save as a matter of course (Lightning's own
``ModelCheckpoint`` never reads its files back, so it does not notice).

:func:`load_checkpoint` tries ``weights_only=True`` first. When that refuses a global, it reads the file once more
with an unpickler that resolves only what ``weights_only`` allows (torch's allowlist and the globals a user added with
``torch.serialization.add_safe_globals``) and puts an inert :class:`Unloaded` placeholder, naming the object, in place
of anything else. No constructor, function or ``__setstate__`` of an unknown class runs: the placeholder records the
arguments it was given, so the result is as safe as ``weights_only`` and the tensors are the same.
"""

from __future__ import annotations

import _compat_pickle
import os
import pickle
import types
from typing import Any

import torch


class Unloaded:
    """Stands for an object that a checkpoint holds but :func:`load_checkpoint` did not build (e.g. a ``Path`` or a
    class among the hyperparameters): ``qualname`` names it, ``args``/``state`` are what would have built it."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Unloaded:
        """A call recorded, not made (a pickle may call what it built, e.g. ``getattr(cls, name)(...)``)."""
        called = _placeholder("", f"{self!r}(...)")()
        called.args, called.kwargs = args, kwargs
        return called

    def __repr__(self) -> str:
        described = f"{self.qualname}{self.args!r}" if self.args else self.qualname
        return f"<not loaded: {described[:200]}>"


def _placeholder(module: str, name: str) -> type:
    qualname = f"{module}.{name}" if module else name
    return type(name if module else "Unloaded", (Unloaded,), {"qualname": qualname, "__module__": __name__})


def _allowed() -> dict[str, Any]:
    from torch import _weights_only_unpickler as allowlist

    return {**allowlist._get_allowed_globals(), **allowlist._get_user_allowed_globals()}


class _PlaceholderUnpickler(pickle.Unpickler):
    """Resolves the globals ``weights_only`` allows; every other one becomes an :class:`Unloaded` subclass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._allowed = _allowed()  # once per file (the user's additions are read when the file is)

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names, as pickle's own find_class maps them (torch saves with protocol 2); none is a Python 3 name
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        found = self._allowed.get(f"{module}.{name}")
        return found if found is not None else _placeholder(module, name)


_PICKLE = types.ModuleType("lit_trainer_placeholder_pickle")
_PICKLE.Unpickler = _PlaceholderUnpickler  # type: ignore[attr-defined]
_PICKLE.load = pickle.load  # type: ignore[attr-defined]  (torch reads the legacy format's magic number with it)
_PICKLE.__dict__["UnpicklingError"] = pickle.UnpicklingError


def load_checkpoint(path: str | os.PathLike, *, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """``torch.load`` of a checkpoint, safe, that does not fail on objects in its hyperparameters (module docstring).

    Args:
        path: a ``.ckpt`` file (or a distributed checkpoint's ``meta.pt``).
        map_location: as ``torch.load``.
        mmap: memory-map the file (only the parts read are loaded).

    Raises:
        pickle.UnpicklingError: the file cannot be read even so (the ``weights_only`` error is raised).
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as refused:
        try:
            return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap, pickle_module=_PICKLE)
        except Exception:
            raise refused from None
