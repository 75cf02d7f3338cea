"""orjson where the operator decodes the most JSON: kopf's watch streams and kube.py's responses.

At 100 new jobs, decoding watch events with the json module was 15% of the operator's CPU
(py-spy, bench/control_plane.py --profile, issue 30): every pod, Job and EndpointSlice update
arrives whole, managedFields included. orjson decodes the same text to the same dicts and lists
2-3x faster.

kopf reads each watch line with `json.loads` of its own module `kopf._cogs.clients.api` and has
no setting for the decoder, so `install()` gives that module a `json` whose `loads` is this
one's `watch_event` (everything else is the json module's). tests/unit/test_fastjson.py fails if a kopf
release stops decoding there, rather than letting the speed-up vanish unnoticed.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# The same values as json.loads for whatever an API server sends: it decodes every number into an
# int64 or a float64 before storing it (apimachinery's JSON), so no object holds the integers
# beyond 64 bits that orjson reads as floats. orjson.JSONDecodeError is a json.JSONDecodeError.
loads = orjson.loads


def watch_event(data: str | bytes) -> Any:
    """One watch event, without its object's metadata.managedFields: nothing in kopf or trainop
    reads them, and on a pod they are a third of what a decoded event holds while it waits in
    kopf's queues for its turn (thousands of events during a burst of new jobs)."""
    event = orjson.loads(data)
    obj = event.get("object") if isinstance(event, dict) else None
    if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
        obj["metadata"].pop("managedFields", None)
    return event


class _Json:
    """The json module, with watch_event as loads (kopf's api module decodes only watch lines
    with it)."""

    loads = staticmethod(watch_event)

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


def install() -> None:
    """kopf's watch streams decode with `watch_event` (idempotent)."""
    from kopf._cogs.clients import api

    if not isinstance(api.json, _Json):
        api.json = _Json()
