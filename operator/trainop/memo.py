"""What decide() may remember between reconciles: pure results that are costly to recompute
(a spec parsed, a gang rendered, a Job bound to its class or gang scheduler). The controller
owns one `Memos` and hands it to each snapshot and to its gate; decide() works without one
(tests, the CLI), only slower. Nothing here is module state.

Keys are the identity of an input object plus what else the result depends on; the entry holds
that object, so its id() cannot be reused by another object while cached. Locking: `Memo._lock`
guards the dict only; the result is computed outside it (pure, so two threads that miss at once
both compute the same value and one wins), which keeps a slow render from blocking other jobs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LIMIT = 4096  # entries per memo: above the jobs an operator serves; the oldest goes first


class Memo:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._entries: dict[tuple, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def get(self, owner: Any, key: Any, make: Callable[[], Any]) -> Any:
        """The value for (`owner`'s identity, `key`), made by `make()` on a miss."""
        full = (id(owner), key)
        with self._lock:
            hit = self._entries.get(full)
        if hit is not None and hit[0] is owner:
            return hit[1]
        value = make()
        with self._lock:
            if len(self._entries) >= self.limit:
                self._entries.pop(next(iter(self._entries)))  # oldest first: dicts keep order
            self._entries[full] = (owner, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class Memos:
    parsed: Memo = field(default_factory=Memo)  # spec.parse_cached: (config, spec) -> Job
    gangs: Memo = field(default_factory=Memo)   # admission.gang_pods: Job -> its pods
    bound: Memo = field(default_factory=Memo)   # priority.bind, podgroup.bind: Job -> Job
