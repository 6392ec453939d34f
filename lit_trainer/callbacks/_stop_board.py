"""How a rank that a signal reached tells the other ranks, while they generate, that a stop is due.

:class:`~lit_trainer.callbacks.JITCheckpoint` makes the ranks agree on a stop with an all-reduce, which a rank can
only join after its generation call. A signal that reaches one rank only (``kill`` of one process, a container's
SIGTERM to its first process while Lightning's launcher started the others as its children) would then leave the
others generating a whole round, minutes, while the signalled rank waits. So the signalled rank also sets a key in
the process group's store (the rendezvous ``TCPStore``: a host-side key-value server, no collective, served while
every rank computes), and a rank whose stopping criterion finds it ends its generation too. It is a hint only: the
all-reduce in ``stop_in_step`` still decides, and it stops every rank, since the rank that set the key has its
request due.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import torch.distributed as dist

_PREFIX = "lit_trainer/jit_stop/"


class StopBoard:
    """A key in the process group's store: :meth:`post` sets it, :meth:`seen` polls it (at most every ``interval``
    seconds: the criterion reads it after every token). Without a process group (one process) it does nothing."""

    def __init__(self, store: Any | None = None, key: str = "", interval: float = 0.1) -> None:
        self._store, self._key, self.interval = store, key, interval
        self._posted, self._seen, self._polled_at = False, False, -float("inf")

    @classmethod
    def open(cls, trainer: Any) -> StopBoard:
        """A board for this fit, the same key on every rank (every rank must call it: rank 0 broadcasts the key, so a
        later fit in the same process group starts clean)."""
        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return cls()
        key = trainer.strategy.broadcast(_PREFIX + uuid.uuid4().hex)
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):  # no store to reach: the ranks learn at the all-reduce
            return cls()
        return cls(store, key)

    def post(self) -> None:
        """Tell the other ranks (once)."""
        if self._store is None or self._posted:
            return
        self._posted = True
        with contextlib.suppress(RuntimeError):  # a store that is gone: the all-reduce still tells them
            self._store.set(self._key, "1")

    def seen(self) -> bool:
        """Whether a rank has posted (polled at most every ``interval`` seconds; True stays True)."""
        if self._store is None or self._seen:
            return self._seen
        now = time.monotonic()
        if now - self._polled_at < self.interval:
            return False
        self._polled_at = now
        with contextlib.suppress(RuntimeError):
            self._seen = bool(self._store.check([self._key]))
        return self._seen
