"""Awaiting the user's coroutines from synchronous training code: async reward functions, async tools and an async
``get_reward`` of an environment (TRL 1.16 accepts all three).

They run on one event loop in a daemon thread, started on first use and kept for the process's life, so:

* a coroutine works the same in a script and in a notebook (whose own loop is already running in the main thread,
  where ``asyncio.run`` would refuse);
* clients bound to a loop (an ``aiohttp`` session, an async judge client) can be created once and reused across
  rounds, as they must stay on the loop they were made on;
* the awaitables of one call are awaited together (``asyncio.gather``): a round's async tool calls or async reward
  functions overlap their waiting instead of queueing.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Sequence
from typing import Any

_LOOP: asyncio.AbstractEventLoop | None = None
_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="lit-trainer-async", daemon=True).start()
            _LOOP = loop
        return _LOOP


def resolve_awaitables(values: Sequence[Any]) -> list[Any]:
    """``values`` with every awaitable among them replaced by its result, all awaited together on the background
    loop; an awaitable that raised is replaced by its exception (the caller decides whether that is an error result
    or a failure). Without awaitables nothing is started.

    Example: ``resolve_awaitables([1, coroutine returning 2])`` -> ``[1, 2]``.
    """
    values = list(values)
    pending = [i for i, value in enumerate(values) if inspect.isawaitable(value)]
    if not pending:
        return values

    async def gather() -> list[Any]:
        return await asyncio.gather(*(values[i] for i in pending), return_exceptions=True)

    for i, result in zip(pending, asyncio.run_coroutine_threadsafe(gather(), _loop()).result()):
        values[i] = result
    return values
