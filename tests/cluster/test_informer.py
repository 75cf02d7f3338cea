"""The operator's own watches (informer.py, handlers/caches.py) against the real API server: they
list, then follow each change; they watch exactly the namespaces `trainop operator -n` names, by
name or by kopf's patterns (namespaces that come later too), a job's children by the job label
only (server-side); and a list reports the objects that went while no watch ran as deleted,
with their last state.

What the cache calls on the controller is recorded by `Wakes`, the test's observer (a real
Controller would reconcile the jobs it names: tests/cluster/test_dtj.py runs that whole)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import threading

import pytest

from tests.fixtures.waiting import wait_until
from trainop import informer, kube
from trainop.handlers import caches
from trainop.render.common import LABEL_JOB

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


class Wakes:
    """The controller's wake-ups the pod cache calls, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.applier = self

    def seen(self, kind, body):
        pass

    def __getattr__(self, name):  # enqueue_job, enqueue_stage, pod_departed, wake_gate
        return lambda *args: self.calls.append((name, *args))


@pytest.fixture
def loop(cluster):
    """An event loop in a thread of its own (the operator's runs kopf's), and kube pointed at
    the cluster."""
    saved = kube._client
    kube.configure(cluster.api_client())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    kube._client = saved


def in_loop(loop, fn):
    """fn() run in the loop (where the cache changes), its result here."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    loop.call_soon_threadsafe(lambda: done.set_result(fn()))
    return done.result(10)


def start(loop, patterns: list[str]) -> tuple[informer.Watches, Wakes]:
    """The operator's own watches (caches.WATCHED) over `patterns`, feeding a pod cache and a
    children cache that wake `Wakes`."""
    wakes = Wakes()
    own = {cls: cls(wakes) for cls in (caches.PodCache, caches.ChildCache)}
    synced = in_loop(loop, asyncio.Event)
    watches = informer.Watches(patterns, caches.watches(own), loop, synced)
    watches.caches, watches.synced = own, synced
    watches.start()
    return watches, wakes


def pod(name: str, job: str | None = None) -> dict:
    labels = {LABEL_JOB: job} if job else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "pause"}]}}


def job_pods(loop, cache, ns: str, job: str) -> list[str]:
    return in_loop(loop, lambda: sorted(p["metadata"]["name"] for p in cache.ix["dtj_pods"].get((ns, job), [])))


def held(loop, watches) -> list[tuple]:
    """(kind, namespace, name) of everything the caches hold."""
    return in_loop(loop, lambda: sorted((o["kind"], o["metadata"]["namespace"], o["metadata"]["name"])
                                        for c in watches.caches.values() for o, _ in c.held.values()))


def test_a_named_namespaces_pods_come_change_and_go(cluster, namespace, loop):
    cluster.apply(pod("before", "j"), namespace)
    cluster.apply(pod("other"), namespace)  # no label of ours: not held
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "labels": {LABEL_JOB: "j"}},
               "spec": {"clusterIP": "None", "selector": {LABEL_JOB: "j"}}}
    cluster.apply([service, {**service, "metadata": {"name": "unlabelled"}}], namespace)
    watches, wakes = start(loop, [namespace])
    cache = watches.caches[caches.PodCache]
    try:
        wait_until(lambda: in_loop(loop, watches.synced.is_set), timeout=30, what="the first lists")
        # in before the barrier; the unlabelled Service never sent (the job-label selector)
        assert held(loop, watches) == [("Pod", namespace, "before"), ("Service", namespace, "s")]
        assert ("enqueue_job", namespace, "j") in wakes.calls
        cluster.apply(pod("after", "j"), namespace)
        wait_until(lambda: job_pods(loop, cache, namespace, "j") == ["after", "before"], timeout=30,
                   what="the new pod in the cache")
        cluster.kubectl("label", "-n", namespace, "pod/after", f"{LABEL_JOB}-")  # no longer the job's
        wait_until(lambda: job_pods(loop, cache, namespace, "j") == ["before"], timeout=30,
                   what="the unlabelled pod out of the job's")
        wakes.calls.clear()
        cluster.kubectl("delete", "-n", namespace, "pod/before", "--grace-period=0", "--force")
        wait_until(lambda: job_pods(loop, cache, namespace, "j") == [], timeout=30, what="the pod gone")
        departed = in_loop(loop, lambda: [c for c in wakes.calls if c[0] == "pod_departed"])
        assert [(c[1], c[2], c[3]["metadata"]["name"]) for c in departed] == [(namespace, "j", "before")]
        assert ("wake_gate", namespace) in wakes.calls
    finally:
        watches.stop()


def test_a_pattern_watches_the_namespaces_it_matches_also_those_made_later(cluster, loop):
    prefix = f"inf-{secrets.token_hex(3)}"
    first, later, other = f"{prefix}-a", f"{prefix}-b", f"x{prefix}-c"
    made = []
    try:
        for ns in (first, other):
            cluster.kubectl("create", "namespace", ns)
            made.append(ns)
        for ns in (first, other):
            wait_until(lambda ns=ns: cluster.kubectl("get", "-n", ns, "sa", "default", check=False).returncode == 0,
                       timeout=30, what=f"ServiceAccount default in {ns}")
            cluster.apply(pod("p", "j"), ns)
        watches, wakes = start(loop, [f"{prefix}-*"])
        cache = watches.caches[caches.PodCache]
        try:
            wait_until(lambda: in_loop(loop, watches.synced.is_set), timeout=30, what="the first lists")
            assert job_pods(loop, cache, first, "j") == ["p"]
            cluster.kubectl("create", "namespace", later)
            made.append(later)
            wait_until(lambda: cluster.kubectl("get", "-n", later, "sa", "default", check=False).returncode == 0,
                       timeout=30, what=f"ServiceAccount default in {later}")
            cluster.apply(pod("p", "j"), later)
            wait_until(lambda: job_pods(loop, cache, later, "j") == ["p"], timeout=30,
                       what="the pod of a namespace made after the start")
            assert job_pods(loop, cache, other, "j") == []  # (a namespace the pattern does not match)
            assert set(watches.watches) == {first, later}
        finally:
            watches.stop()
    finally:
        cluster.kubectl("delete", "namespace", *made, "--wait=false", check=False)


def test_a_new_list_reports_the_pods_gone_meanwhile_as_deleted_and_watches_on(cluster, namespace, loop):
    """What a watch does after the API server said its version is gone (410, after an etcd
    compaction: tests/unit/test_informer.py) or at its start: list, compare with what the cache
    held, and report a pod that went while no watch ran as deleted, with its last state."""
    cluster.apply(pod("alive", "j"), namespace)
    wakes = Wakes()
    cache = caches.PodCache(wakes)
    ghost = pod("ghost", "j")  # the cache's view from before: a pod deleted while no watch ran
    ghost["metadata"].update(namespace=namespace, uid="uid-of-a-pod-gone", resourceVersion="1")
    in_loop(loop, lambda: cache.observe("ADDED", ghost))
    assert job_pods(loop, cache, namespace, "j") == ["ghost"]
    wakes.calls.clear()
    watch = informer.Informer(kube.path("v1", "Pod", namespace), "Pod", loop,
                              lambda items: cache.replace(namespace, items, "Pod"), cache.observe).start()
    try:
        wait_until(lambda: job_pods(loop, cache, namespace, "j") == ["alive"], timeout=30,
                   what="the list")
        departed = in_loop(loop, lambda: [c for c in wakes.calls if c[0] == "pod_departed"])
        assert [(c[2], c[3]["metadata"]["name"]) for c in departed] == [("j", "ghost")]
        cluster.apply(pod("next", "j"), namespace)  # and it watches on from the list's version
        wait_until(lambda: job_pods(loop, cache, namespace, "j") == ["alive", "next"], timeout=30,
                   what="a change after the list")
    finally:
        watch.stop()
