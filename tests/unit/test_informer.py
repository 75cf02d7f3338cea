"""informer.Informer's protocol with the API server, on a FAKE one (named so: the real API
server answers 410 Gone only for a version older than its watch cache's history and etcd's
compaction, which no test here can bring about on demand; tests/cluster/test_informer.py runs
the informer against the real one for the rest): a 410, as an ERROR event or as the answer to
the request, lists again; a bookmark only moves the version on; a broken connection watches
again from the last version seen, with one WARNING and one INFO line."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from trainop import informer, kube


def pod(name: str, rv: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": "ns", "uid": name, "resourceVersion": str(rv)}}


class FakeApi:
    """A FAKE API server: each list returns `pods`, each watch request plays the next script."""

    def __init__(self, pods: list[dict], scripts: list) -> None:
        self.pods, self.scripts = pods, list(scripts)
        self.requests: list[tuple[str, str | None]] = []
        self.played, self.release = threading.Event(), threading.Event()

    def request(self, method, path, **_):
        self.requests.append(("list", None))
        return {"apiVersion": "v1", "metadata": {"resourceVersion": "100"},
                "items": [{k: v for k, v in p.items() if k not in ("apiVersion", "kind")} for p in self.pods]}

    def watch(self, path, rv, timeout, selector=None):
        self.requests.append(("watch", rv))
        if not self.scripts:  # all played: this watch waits until the test has stopped it
            self.played.set()
            self.release.wait(10)
            return
        script = self.scripts.pop(0)
        if isinstance(script, Exception):
            raise script
        yield from script


def run(api: FakeApi, monkeypatch, resource_version: str | None = None) -> list[tuple]:
    """Run one informer over the fake's scripts; what reached the loop, in order."""
    monkeypatch.setattr(kube, "request", api.request)
    monkeypatch.setattr(kube, "watch", api.watch)
    monkeypatch.setattr(informer, "BACKOFFS", (0,))
    seen: list[tuple] = []

    async def main():
        loop = asyncio.get_running_loop()
        inf = informer.Informer("/api/v1/namespaces/ns/pods", "Pod", loop,
                                lambda items: seen.append(("list", [i["metadata"]["name"] for i in items])),
                                lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                                resource_version=resource_version)
        inf.start()
        # (what it handed the loop before the last watch is ahead of this wait's own wake-up)
        assert await asyncio.to_thread(api.played.wait, 10)
        inf.stop()
        api.release.set()
        await asyncio.to_thread(inf.thread.join, 10)
        assert not inf.thread.is_alive()
    asyncio.run(main())
    return seen


def test_a_410_error_event_lists_again(monkeypatch):
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version: 5 (90)"}}
    api = FakeApi([pod("a", 95)], [[{"type": "MODIFIED", "object": pod("a", 96)}, gone]])
    seen = run(api, monkeypatch, resource_version="5")
    assert seen == [("MODIFIED", "a"), ("list", ["a"])]
    assert api.requests == [("watch", "5"), ("list", None), ("watch", "100")]


def test_a_410_answer_lists_again(monkeypatch):
    api = FakeApi([pod("a", 95)], [ApiException(status=410, reason="Gone")])
    assert run(api, monkeypatch, resource_version="5") == [("list", ["a"])]
    assert api.requests == [("watch", "5"), ("list", None), ("watch", "100")]


def test_a_bookmark_moves_the_version_and_reaches_no_one(monkeypatch):
    bookmark = {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "150"}}}
    api = FakeApi([pod("a", 95)], [[bookmark], [{"type": "ADDED", "object": pod("b", 160)}]])
    assert run(api, monkeypatch) == [("list", ["a"]), ("ADDED", "b")]
    assert api.requests == [("list", None), ("watch", "100"), ("watch", "150"), ("watch", "160")]


def test_a_broken_connection_watches_again_from_the_last_version_saying_so_once(monkeypatch, caplog):
    broken = urllib3.exceptions.ProtocolError("Response ended prematurely")
    api = FakeApi([pod("a", 95)], [[{"type": "MODIFIED", "object": pod("a", 120)}], broken, broken,
                                   [{"type": "MODIFIED", "object": pod("a", 130)}]])
    with caplog.at_level(logging.INFO, logger="trainop.informer"):
        seen = run(api, monkeypatch)
    assert seen == [("list", ["a"]), ("MODIFIED", "a"), ("MODIFIED", "a")]
    assert api.requests == [("list", None), ("watch", "100"), ("watch", "120"), ("watch", "120"),
                            ("watch", "120"), ("watch", "130")]
    lines = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert lines[:2] == [("WARNING", "watching /api/v1/namespaces/ns/pods failed"),
                         ("INFO", "watching /api/v1/namespaces/ns/pods again")]


@pytest.mark.parametrize("patterns, plain", [([], True), (["a", "b-c"], True), (["a-*"], False),
                                             (["!kube-*"], False), (["a,b"], False)])
def test_names_and_patterns(patterns, plain):
    assert informer.plain(patterns) is plain


def test_an_answer_it_cannot_read_is_an_error_said_once_and_a_new_list(monkeypatch, caplog):
    garbled = {"type": "MODIFIED", "object": {"kind": "Pod"}}  # no metadata
    api = FakeApi([pod("a", 95)], [[garbled]])
    with caplog.at_level(logging.INFO, logger="trainop.informer"):
        seen = run(api, monkeypatch)
    assert seen == [("list", ["a"]), ("list", ["a"])]
    assert api.requests == [("list", None), ("watch", "100"), ("list", None), ("watch", "100")]
    assert [r.levelname for r in caplog.records] == ["ERROR", "INFO"]
