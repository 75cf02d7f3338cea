"""trainop.fastjson: kopf's watch streams and kube.py decode with orjson, to the same values the
json module gives for what an API server sends (numbers within int64 and float64)."""

from __future__ import annotations

import asyncio
import json

import pytest
from kopf._cogs.clients import api as kopf_api

from trainop import fastjson


def test_kopf_watch_lines_are_decoded_with_orjson():
    """Through kopf's own stream reader (the code the watch runs), not a copy of it: if a kopf
    release stops decoding lines with its module's json.loads, this fails."""
    fastjson.install()
    fastjson.install()  # idempotent
    assert isinstance(kopf_api.json, fastjson._Json) and kopf_api.json.dumps is json.dumps
    calls = []
    real = fastjson.loads

    def counting(data):
        calls.append(data)
        return real(data)

    event = {"type": "MODIFIED", "object": {"kind": "Pod", "metadata": {"name": "p", "resourceVersion": "7"},
                                           "status": {"podIP": "10.0.0.1", "ratio": 0.5, "ok": True}}}

    class Content:  # the part of aiohttp.StreamReader that iter_jsonlines reads
        def __init__(self, text):
            self.data = text.encode()

        async def iter_chunked(self, size):
            for i in range(0, len(self.data), size):
                yield self.data[i:i + size]

    async def lines():
        out = []
        async for line in kopf_api.iter_jsonlines(Content(json.dumps(event) + "\n")):
            out.append(kopf_api.json.loads(line.decode("utf-8")))
        return out

    kopf_api.json.loads = counting  # an attribute of the installed shim, not of the json module
    try:
        assert asyncio.run(lines()) == [event]
    finally:
        kopf_api.json.loads = real
    assert len(calls) == 1
    import inspect
    assert "json.loads(" in inspect.getsource(kopf_api.stream), \
        "kopf's stream() no longer decodes with its module's json.loads: fastjson.install is moot"


@pytest.mark.parametrize("text", [
    '{"a": [1, 2.5, "x", null, true, {"b": {}}]}',
    '{"max": 9223372036854775807, "min": -9223372036854775808, "f": 1e300}',  # int64, float64
    '{"u": "\\u00e9\\ud83d\\ude00"}',
])
def test_loads_gives_what_the_json_module_gives(text):
    assert fastjson.loads(text) == json.loads(text)
    assert fastjson.loads(text.encode()) == json.loads(text)


def test_malformed_json_raises_the_json_module_error():
    with pytest.raises(json.JSONDecodeError):
        fastjson.loads('{"a": ')
