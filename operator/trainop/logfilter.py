"""kopf logs every failed attempt of a request it is going to retry as an ERROR ("Request attempt
#3/9 failed; will retry: GET ... -> ClientConnectorError(...)"): while the API server restarts
that is one ERROR per watch stream per attempt, 74 lines for a 5 s outage (bench/chaos.py), for
a state that heals itself. An operator's ERROR must mean that someone has to act.

`RetryNoise` turns those lines into one WARNING per `window` seconds, which says how many it held
back; kopf's "escalating" line (every attempt spent: the request fails) stays an ERROR. kopf has no
setting for the level of these lines, so a logging filter on the handler (it sees the records of
every kopf logger, including the per-object ones) is the one place to do it."""

from __future__ import annotations

import logging
import time


class RetryNoise(logging.Filter):
    def __init__(self, window: float = 30.0, clock=time.monotonic):
        super().__init__()
        self.window, self.clock = window, clock
        self.shown_at: float | None = None
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name.startswith("kopf.") and record.levelno == logging.ERROR
                and "failed; will retry" in str(record.msg)):
            return True
        now = self.clock()
        if self.shown_at is not None and now - self.shown_at < self.window:
            self.held += 1
            return False
        held, self.held, self.shown_at = self.held, 0, now
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.msg = (f"{record.getMessage()} (the API server is unreachable or overloaded; kopf retries "
                      f"every request; {held} such lines held back, at most one shown per {self.window:.0f}s)")
        record.args = ()
        return True


def install(window: float = 30.0) -> None:
    """Add RetryNoise to every handler of the root logger (where kopf.configure put its own)."""
    noise = RetryNoise(window)
    for handler in logging.getLogger().handlers:
        handler.addFilter(noise)
