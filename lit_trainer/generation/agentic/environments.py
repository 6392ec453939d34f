"""Environments for GRPO rollouts (TRL 1.16's ``environment_factory``): stateful objects whose public methods are the
model's tools.

* ``environment_factory`` is a callable returning a new environment, or a dict ``{name: factory}``; with a dict each
  prompt row picks its factory by its ``environment`` column.
* Every rollout (each of a prompt's ``num_generations`` completions) gets its own instance. Instances are made once
  and reused: a round takes them from a pool in row order, growing it when a round needs more.
* ``reset(**row)`` is called at the start of a rollout with the prompt row (``prompt`` and the other columns, not
  ``environment``); a string it returns is appended to the content of the prompt's last message.
* ``reset``, the tools and ``get_reward`` may be ``async def``: the awaitables of a round are awaited together on a
  background event loop (:mod:`lit_trainer.core.awaitables`).
* The public methods other than ``reset`` and ``get_reward`` are tools (they need type hints and a docstring, see
  :mod:`lit_trainer.generation.agentic.tools`; checked on a first instance when the module is built), bound to
  the rollout's instance. An environment without any (and no ``tools=``) is warned about: its rollouts are one turn.
* ``get_reward()`` (when the class defines it) is an extra reward function named after the class, weight 1.0: it scores
  the rollouts of that class (None, unscored, for the others).

An environment's Python state lives only while a round is generated and scored, inside one micro-step, so a
checkpoint never needs it (the scored rollouts are in the checkpoint; see :mod:`lit_trainer.modules.grpo`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lit_trainer.core.awaitables import resolve_awaitables
from lit_trainer.core.import_path import import_object
from lit_trainer.generation.agentic.tools import check_tool_schema

EnvironmentFactory = Callable[[], Any]
ENVIRONMENT_COLUMN = "environment"
_RESERVED = ("reset", "get_reward")


def _resolve(factory: str | EnvironmentFactory) -> EnvironmentFactory:
    if isinstance(factory, str):
        factory = import_object(
            factory, "Environment factory", "give 'package.module.Class' of an importable class or function."
        )
    if not callable(factory):
        raise ValueError(f"Environment factory {factory!r} is not callable: give a class or a function.")
    return factory


def describe_factories(factory: Any) -> Any:
    """What the hyperparameters record for ``environment_factory``: import paths as given, else names."""

    def name(f: Any) -> str:
        return f if isinstance(f, str) else getattr(f, "__qualname__", type(f).__name__)

    return {k: name(f) for k, f in factory.items()} if isinstance(factory, dict) else name(factory)


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """The public methods of an environment's class other than ``reset``/``get_reward``, bound to it."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in _RESERVED
    ]


class Environments:
    """The environment factories of a GRPOModule, their instance pools and reward functions.

    Args:
        factory: a factory, its import path, or a dict ``{name: factory}`` selected by the ``environment`` column.
        tools: the module's other tools (given to every rollout): without them, an environment without public methods
            is warned about (its rollouts would have no tool to call).

    Raises:
        ValueError: for a factory that does not import or is not callable, an environment without ``reset``, or a
            tool method transformers cannot describe (see
            :func:`~lit_trainer.generation.agentic.tools.check_tool_schema`).
    """

    def __init__(
        self,
        factory: EnvironmentFactory | str | dict[str, EnvironmentFactory | str],
        tools: Sequence[Callable[..., Any]] = (),
    ) -> None:
        self.multi = isinstance(factory, dict)
        items = factory.items() if isinstance(factory, dict) else [(None, factory)]
        self.factories = {name: _resolve(f) for name, f in items}
        self.pools: dict[Any, list[Any]] = {}
        self.reward_funcs: list[Callable[..., Any]] = []
        self.reward_names: list[str] = []
        for name, make in self.factories.items():
            probe = make()
            _check_environment(probe, "environment_factory" + ("" if name is None else f"[{name!r}]"), bool(tools))
            self.pools[name] = [probe]
            kind = type(probe)
            if callable(getattr(probe, "get_reward", None)) and kind.__name__ not in self.reward_names:
                self.reward_funcs.append(_EnvironmentReward(kind))
                self.reward_names.append(kind.__name__)

    def assign(self, columns: dict[str, Sequence[Any]], rows: int) -> list[Any]:
        """One instance per rollout row (pooled, row order), chosen by the ``environment`` column for a dict.

        Raises:
            ValueError: a dict factory and no ``environment`` column, or a name that is not a key of the dict.
        """
        if self.multi:
            if ENVIRONMENT_COLUMN not in columns:
                raise ValueError(
                    "environment_factory is a dict, so every prompt row needs an 'environment' column naming its "
                    f"environment (one of {sorted(self.factories)})."
                )
            names = list(columns[ENVIRONMENT_COLUMN])
        else:
            names = [None] * rows
        taken: dict[Any, int] = {}
        instances = []
        for name in names:
            if name not in self.factories:
                raise ValueError(
                    f"A prompt row has environment={name!r}, which is not a key of environment_factory "
                    f"({sorted(self.factories)}): fix the 'environment' column or add that factory."
                )
            index = taken.get(name, 0)
            pool = self.pools[name]
            if index == len(pool):
                pool.append(self.factories[name]())
            taken[name] = index + 1
            instances.append(pool[index])
        return instances

    def reset(self, instances: Sequence[Any], prompts: list[Any], columns: dict[str, Sequence[Any]]) -> list[Any]:
        """``reset(**row)`` every rollout's instance; a returned string is appended to its prompt's last message.

        Returns the prompts (new message lists where changed; the inputs are not modified)."""
        observations = []
        for i, environment in enumerate(instances):
            row = {"prompt": prompts[i], **{k: v[i] for k, v in columns.items()}}
            if self.multi:
                row.pop(ENVIRONMENT_COLUMN)
            observations.append(environment.reset(**row))
        observations = resolve_awaitables(observations)
        for environment, observation in zip(instances, observations):
            if isinstance(observation, BaseException):  # an async reset raised
                raise RuntimeError(f"{type(environment).__name__}.reset raised: {observation!r}") from observation
        out = []
        for prompt, observation in zip(prompts, observations, strict=True):
            if isinstance(observation, str) and observation:
                last = prompt[-1]
                prompt = [*prompt[:-1], {**last, "content": last["content"] + observation}]
            out.append(prompt)
        return out


def _check_environment(probe: Any, source: str, other_tools: bool) -> None:
    """Refuse an environment without ``reset`` (naming the tools too when it has none) or with a tool method
    transformers cannot describe; warn when its rollouts would have no tool at all."""
    kind = type(probe).__name__
    tools = environment_tools(probe)
    if not callable(getattr(probe, "reset", None)):
        missing, also = "`reset` method", ""
        if not tools:  # nothing defined at all: say what an environment is made of
            missing += " and no public methods (its tools)"
            also = (
                ", and the tools the model may call as public methods with type hints and a Google docstring, e.g. "
                "`def add(self, a: int, b: int) -> int`"
            )
        raise ValueError(
            f"Environment {kind} (from {source}) has no {missing}: define `reset(self, **row)` (it may return text "
            f"for the prompt){also}."
        )
    for tool in tools:
        check_tool_schema(tool, f" (a method of environment {kind} from {source})")
    if not tools and not other_tools:
        rank_zero_warn(
            f"[lit_trainer] Environment {kind} (from {source}) has no public method besides `reset` and `get_reward`, "
            "and `tools` is empty: its rollouts have no tool to call, so the model answers in one turn. An "
            "environment's tools are its public methods (with type hints and a Google docstring; a name starting "
            "with '_' is not a tool). Ignore this if the environment only makes the prompt and scores it."
        )


class _EnvironmentReward:
    """The reward function of the environments of class ``kind``: their ``get_reward()`` (None for other rows); when
    ``get_reward`` is ``async def`` it returns one awaitable of all of them, which the reward caller awaits. An object,
    not a closure, so the environments pickle to an asynchronous rollout worker; named after the class."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.__name__ = kind.__name__

    def __call__(self, completions: list[Any], environments: Sequence[Any] = (), **_: Any) -> Any:
        values = [e.get_reward() if type(e) is self.kind else None for e in environments]
        if not any(inspect.isawaitable(v) for v in values):
            return values

        async def awaited() -> list[Any]:
            results = iter(await asyncio.gather(*(v for v in values if inspect.isawaitable(v))))
            return [next(results) if inspect.isawaitable(v) else v for v in values]

        return awaited()
