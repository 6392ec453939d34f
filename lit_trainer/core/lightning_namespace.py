"""One implementation per callback, one class per Lightning package name (``lightning.pytorch``, ``pytorch_lightning``).

Lightning ships the same code under two package names whose classes are distinct: a ``pytorch_lightning.Trainer``
recognises its checkpoint callback by ``isinstance(cb, pytorch_lightning.callbacks.Checkpoint)``, and Lightning's
helpers (``is_overridden``, the strategies) only know their own package's classes. So a callback class can serve
one package only. Each callback here is written as an implementation class with no Lightning base, plus a public
class that adds the ``lightning.pytorch`` base (``class BEMA(_BEMA, Callback)``); :func:`twin` builds the same
public class on the ``pytorch_lightning`` bases (``lit_trainer.callbacks.pytorch_lightning``). Inside the
implementation, everything that depends on the package goes through ``self._ns`` (a :class:`LightningNamespace`).
The loggers (``lit_trainer.loggers.pytorch_lightning``) and the resume choice use the same namespaces, so this lives
in ``core``, below the callbacks.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Package = Literal["lightning.pytorch", "pytorch_lightning"]

# what a public class may define itself: everything else belongs in its implementation class
# (``__slotnames__``: copyreg caches it on a class the first time an instance is copied or pickled)
_PUBLIC_CLASS_KEYS = {
    "__module__",
    "__qualname__",
    "__doc__",
    "__firstlineno__",
    "__static_attributes__",
    "__slotnames__",
}


@dataclass(frozen=True)
class LightningNamespace:
    """The package-dependent names the callbacks use, from one of Lightning's two packages."""

    package: str
    Trainer: type
    Callback: type
    Checkpoint: type
    ModelCheckpoint: type
    EarlyStopping: type
    OnExceptionCheckpoint: type
    SingleDeviceStrategy: type
    DDPStrategy: type
    FSDPStrategy: type
    DeepSpeedStrategy: type
    ModelParallelStrategy: type
    is_overridden: Callable[..., bool]
    rank_zero_info: Callable[..., Any]
    rank_zero_warn: Callable[..., Any]


@functools.cache
def namespace(package: Package) -> LightningNamespace:
    """The :class:`LightningNamespace` of ``package``.

    Raises:
        ModuleNotFoundError: ``package`` is not installed (the message says which extra to install).
    """
    try:
        callbacks = importlib.import_module(f"{package}.callbacks")
    except ModuleNotFoundError as err:
        dist = "pytorch-lightning" if package == "pytorch_lightning" else "lightning"
        raise ModuleNotFoundError(
            f"lit_trainer's callbacks for `{package}` need that package: `pip install {dist}`."
        ) from err
    trainer = importlib.import_module(package).Trainer
    strategies = importlib.import_module(f"{package}.strategies")
    utilities = importlib.import_module(f"{package}.utilities")
    return LightningNamespace(
        package=package,
        Trainer=trainer,
        Callback=callbacks.Callback,
        Checkpoint=callbacks.Checkpoint,
        ModelCheckpoint=callbacks.ModelCheckpoint,
        EarlyStopping=callbacks.EarlyStopping,
        OnExceptionCheckpoint=callbacks.OnExceptionCheckpoint,
        SingleDeviceStrategy=strategies.SingleDeviceStrategy,
        DDPStrategy=strategies.DDPStrategy,
        FSDPStrategy=strategies.FSDPStrategy,
        DeepSpeedStrategy=strategies.DeepSpeedStrategy,
        ModelParallelStrategy=strategies.ModelParallelStrategy,
        is_overridden=importlib.import_module(f"{package}.utilities.model_helpers").is_overridden,
        rank_zero_info=utilities.rank_zero_info,
        rank_zero_warn=utilities.rank_zero_warn,
    )


LIGHTNING = namespace("lightning.pytorch")
_IMPORT_FROM = {
    "lightning.pytorch": "lit_trainer.callbacks",
    "pytorch_lightning": "lit_trainer.callbacks.pytorch_lightning",
}


def trainer_namespace(trainer: Any) -> LightningNamespace | None:
    """The :class:`LightningNamespace` of the package ``trainer`` is a ``Trainer`` of (only imported packages are
    asked), or None when it is neither package's trainer.

    For code outside a callback that is handed a trainer of either package (a callback has its own ``_ns``)."""
    for package in _IMPORT_FROM:
        if sys.modules.get(package) is not None and isinstance(trainer, namespace(package).Trainer):  # type: ignore[arg-type]
            return namespace(package)
    return None


class PackageBound:
    """Base of every callback implementation class: its Lightning package (``_ns``, set by the public class's
    package) and a ``setup`` check that the trainer comes from the same package, since a callback of the other
    package would be silently half-ignored (not seen as the checkpoint callback, wrong ``isinstance`` answers)."""

    _ns: LightningNamespace = LIGHTNING

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Refuse a trainer of the other Lightning package, naming the import to use; then the base's ``setup``.

        Raises:
            TypeError: ``trainer`` is a ``Trainer`` of the other package.
        """
        ns = trainer_namespace(trainer)
        if ns is not None and ns.package != self._ns.package:
            raise TypeError(
                f"{type(self).__name__} from `{type(self).__module__}` is a `{self._ns.package}` "
                f"callback, but the trainer is a `{ns.package}` one: import it from `{_IMPORT_FROM[ns.package]}`."
            )
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]  (the Lightning base's setup)


def twin(cls: type, package: Package, module: str) -> type:
    """``cls`` rebuilt on ``package``'s Lightning bases, from the same implementation class.

    Args:
        cls: a public callback class ``class X(_X, <lightning.pytorch base>)`` whose body only holds a docstring.
        package: the Lightning package to build it for.
        module: the ``__module__`` of the new class (where it is importable from, e.g. for a YAML ``class_path``).

    Returns:
        A class named like ``cls``, with the same implementation, that is an instance of ``package``'s base.

    Raises:
        TypeError: ``cls`` defines more than a docstring (it would be lost in the twin).
    """
    extra = set(cls.__dict__) - _PUBLIC_CLASS_KEYS
    if extra:
        raise TypeError(
            f"{cls.__qualname__} defines {sorted(extra)} itself; move them to its implementation class "
            "so that every Lightning package gets them."
        )
    ns = namespace(package)
    bases = tuple(
        getattr(ns, base.__name__) if base.__module__.startswith("lightning.pytorch") else base
        for base in cls.__bases__
    )
    body = {"__module__": module, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, "_ns": ns}
    return type(cls.__name__, bases, body)
