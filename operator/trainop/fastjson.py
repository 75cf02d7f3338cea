"""orjson where the operator handles the most JSON: kopf's watch streams, kube.py's requests
and responses, the in-memory digests (`canonical`) and deep copies (`clone`).

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


def _drop_managed_fields(obj: Any) -> None:
    if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
        obj["metadata"].pop("managedFields", None)


def watch_event(data: str | bytes) -> Any:
    """One watch event, without its object's metadata.managedFields: nothing in kopf or trainop
    reads them, and on a pod they are a third of what a decoded event holds while it waits in
    kopf's queues for its turn (thousands of events during a burst of new jobs)."""
    event = orjson.loads(data)
    if isinstance(event, dict):
        _drop_managed_fields(event.get("object"))
    return event


def api_object(data: str | bytes) -> Any:
    """An API response (an object, or a list of them), without managedFields: the controller
    keeps each job's last status-write response until its cache catches up (a few MB of them
    during a 500-job burst, issue 30), and nothing reads the field."""
    obj = orjson.loads(data)
    _drop_managed_fields(obj)
    if isinstance(obj, dict) and isinstance(obj.get("items"), list):
        for item in obj["items"]:
            _drop_managed_fields(item)
    return obj


def dumps(value: Any) -> bytes:
    """A request's body (kube.request), as the Kubernetes client encoded it (its
    sanitize_for_serialization, then json.dumps), 60x faster for a pod: keys that are not
    strings (a YAML label `1: x`) written as strings, datetimes in ISO 8601, anything else
    (a Decimal) as its str()."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS, default=str)


def canonical(value: Any) -> bytes:
    """Sorted-key JSON, for the operator's in-memory keys and digests (apply's last-applied
    digest, the parsed-spec memo): 3-5x faster than json.dumps(sort_keys=True), which was 3 %
    of the operator's CPU at 500 jobs. Never for a digest that is stored (status.admittedShape):
    its bytes differ from json.dumps's, so a stored one would change under running jobs."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str)


def clone(value: Any) -> Any:
    """A deep copy of JSON data (what the API server sends, what the renderers make) through
    orjson: 5-10x faster than copy.deepcopy or a json.dumps/json.loads round trip, which were 3
    and 1.6 % of the operator's CPU over a 100-job ramp (kube.with_owner, the status being
    built; py-spy, 2026-12-06)."""
    return orjson.loads(orjson.dumps(value))


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
