"""A work queue of keys, as client-go's (the one mpi-operator's controller drains): a key added
while already queued is queued once (bursts of watch events coalesce into one reconcile), a key
being processed is never handed to a second worker (one object's reconciles never race), and a
key added meanwhile is queued again when the first is done. `add_after` schedules a key for an
exact moment (a deadline); only the earliest pending moment per key is kept.

Every method must be called from the event loop's thread (kopf's handlers and the workers are).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class WorkQueue:
    def __init__(self) -> None:
        self._ready: asyncio.Queue = asyncio.Queue()
        self._dirty: set[Hashable] = set()       # queued, not yet handed out
        self._processing: set[Hashable] = set()  # handed out, not yet done
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._dirty)

    def add(self, key: Hashable) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._ready.put_nowait(key)

    def add_after(self, key: Hashable, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        timer = self._timers.get(key)
        if timer is not None and not timer.cancelled() and timer.when() <= when:
            return  # an earlier wake-up is already scheduled
        if timer is not None:
            timer.cancel()
        self._timers[key] = loop.call_at(when, self._fire, key)

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def forget(self, key: Hashable) -> None:
        """The object is gone: drop its pending deadline (a queued key still runs once)."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    async def get(self) -> Hashable:
        key = await self._ready.get()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: Hashable) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._ready.put_nowait(key)
