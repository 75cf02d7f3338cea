"""trainop.fastjson: kopf's watch streams and kube.py decode with orjson, to the same values the
json module gives for what an API server sends (numbers within int64 and float64); watch events
lose their object's managedFields, which nothing reads."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json

import pytest
from kopf._cogs.clients import api as kopf_api

from trainop import fastjson

POD_EVENT = {"type": "MODIFIED", "object": {
    "kind": "Pod", "metadata": {"name": "p", "resourceVersion": "7", "labels": {"a": "b"},
                                "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}]},
    "status": {"podIP": "10.0.0.1", "ratio": 0.5, "ok": True}}}


class _Content:
    """The part of aiohttp.StreamReader that kopf's iter_jsonlines reads."""

    def __init__(self, text: str):
        self.data = text.encode()

    async def iter_chunked(self, size):
        for i in range(0, len(self.data), size):
            yield self.data[i:i + size]


def test_kopf_decodes_watch_lines_with_watch_event():
    """kopf's stream() decodes each line with its module's json.loads, which install() makes
    watch_event: if a kopf release decodes elsewhere, this fails instead of the speed-up
    vanishing unnoticed."""
    fastjson.install()
    fastjson.install()  # idempotent
    assert kopf_api.json.loads is fastjson.watch_event
    assert kopf_api.json.dumps is json.dumps  # the rest is the json module's
    assert "json.loads(line.decode('utf-8'))" in inspect.getsource(kopf_api.stream)
    bookmark = {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "9"}}}
    error = {"type": "ERROR", "object": {"kind": "Status", "code": 410}}

    async def decoded():
        text = "".join(json.dumps(e) + "\n" for e in (POD_EVENT, bookmark, error))
        return [kopf_api.json.loads(line.decode("utf-8"))
                async for line in kopf_api.iter_jsonlines(_Content(text), chunk_size=16)]

    want = copy.deepcopy(POD_EVENT)
    del want["object"]["metadata"]["managedFields"]
    assert asyncio.run(decoded()) == [want, bookmark, error]


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
    with pytest.raises(json.JSONDecodeError):
        fastjson.watch_event('{"type": ')


def test_api_responses_lose_managed_fields_and_keep_the_rest():
    """kube.request's responses (an object, or a list) decode without managedFields: the
    controller keeps status-write responses until its cache catches up (issue 30's peak RSS)."""
    pod = POD_EVENT["object"]
    want = copy.deepcopy(pod)
    del want["metadata"]["managedFields"]
    assert fastjson.api_object(json.dumps(pod)) == want
    listed = {"kind": "PodList", "metadata": {"resourceVersion": "5"}, "items": [pod, pod]}
    assert fastjson.api_object(json.dumps(listed).encode()) == {**listed, "items": [want, want]}
    assert fastjson.api_object('{"kind": "Status", "code": 404}') == {"kind": "Status", "code": 404}


def test_canonical_is_the_same_for_the_same_value_in_any_key_order():
    """apply's digest and the parsed-spec memo key: equal values give equal bytes, and any
    difference (a value, a nesting) gives different ones."""
    a = {"b": [1, {"y": 2, "x": 1}], "a": "s"}
    b = {"a": "s", "b": [1, {"x": 1, "y": 2}]}
    assert fastjson.canonical(a) == fastjson.canonical(b)
    assert json.loads(fastjson.canonical(a)) == a
    assert fastjson.canonical(a) != fastjson.canonical({**a, "b": [1, {"x": 1, "y": 3}]})
    assert fastjson.canonical({"t": pytest}) == b'{"t":"' + str(pytest).encode() + b'"}'


def test_clone_is_a_deep_copy_with_the_same_values_and_types():
    value = {"a": [1, 2.5, True, None, {"b": "c"}], "n": 2 ** 62, "f": 1.0, "e": {}, "l": []}
    copy_ = fastjson.clone(value)
    assert copy_ == value and json.dumps(copy_) == json.dumps(value)
    assert type(copy_["f"]) is float and type(copy_["n"]) is int
    copy_["a"][4]["b"] = "changed"
    copy_["e"]["new"] = 1
    assert value["a"][4]["b"] == "c" and value["e"] == {}


def test_a_request_body_is_what_the_kubernetes_client_would_have_sent():
    """kube.request encodes bodies with fastjson.dumps instead of the client's
    sanitize_for_serialization and json.dumps: the same JSON values, also for what YAML gives
    (keys that are not strings, dates, tuples)."""
    import datetime as dt
    import decimal

    import yaml
    from kubernetes.client import ApiClient

    manifest = yaml.safe_load("""
metadata: {name: p, labels: {1: x, app: y}, annotations: {when: 2026-12-08T00:00:00Z}}
spec: {containers: [{name: c, args: ["a", 2, 2.5, true, null]}], ratio: 0.5, big: 9007199254740993}
""")
    manifest["spec"]["tuple"] = (1, 2)
    manifest["spec"]["day"] = dt.date(2026, 12, 8)
    manifest["spec"]["decimal"] = decimal.Decimal("1.5")
    theirs = json.loads(json.dumps(ApiClient().sanitize_for_serialization(manifest)))
    ours = json.loads(fastjson.dumps(manifest))
    assert ours == theirs
