"""orjson where the operator decodes the most JSON: kopf's watch streams and kube.py's responses.

At 100 new jobs, decoding watch events with the json module was 15% of the operator's CPU
(py-spy, bench/control_plane.py --profile, issue 30): every pod, Job and EndpointSlice update
arrives whole, managedFields included. orjson decodes the same text to the same dicts and lists
2-3x faster.

kopf reads each watch line with `json.loads` of its own module `kopf._cogs.clients.api` and has
no setting for the decoder, so `install()` gives that module a `json` whose `loads` is this
one's (everything else is the json module's). tests/unit/test_fastjson.py fails if a kopf
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


class _Json:
    """The json module, with this module's loads."""

    loads = staticmethod(loads)

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


def install() -> None:
    """kopf's watch streams decode with `loads` (idempotent)."""
    from kopf._cogs.clients import api

    if not isinstance(api.json, _Json):
        api.json = _Json()
