"""handlers/caches.py: what the operator's own watches keep and whom each change wakes. The
controller is the test's recorder of wake-ups (tests/unit/test_reconcile_harness.py runs the
real one through the same caches)."""

from __future__ import annotations

from trainop.handlers import caches
from trainop.render.common import LABEL_JOB


class Wakes:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.applier = self

    def seen(self, kind, body):
        self.calls.append(("seen", kind, body["metadata"]["name"]))

    def __getattr__(self, name):  # enqueue_job, enqueue_stage, pod_departed, wake_gate
        return lambda *args: self.calls.append((name, *args))


def obj(kind: str, name: str, job: str | None = "j", uid: str | None = None, **extra) -> dict:
    api = {"Job": "batch/v1", "NetworkPolicy": "networking.k8s.io/v1"}.get(kind, "v1")
    return {"apiVersion": api, "kind": kind, "metadata": {
        "name": name, "namespace": "ns", "uid": uid or f"{kind}-{name}",
        "labels": {LABEL_JOB: job} if job else {}}, **extra}


def test_a_list_of_one_kind_leaves_the_other_kinds_alone_and_reports_its_missing_ones_deleted():
    wakes = Wakes()
    cache = caches.ChildCache(wakes)
    for kind, name in (("Service", "j"), ("Service", "j-launcher"), ("Job", "j-launcher")):
        cache.observe("ADDED", obj(kind, name))
    wakes.calls.clear()
    cache.replace("ns", [obj("Service", "j")], "Service")  # j-launcher's Service went meanwhile
    held = sorted((k[2], o["metadata"]["name"]) for k, store in cache.ix["dtj_children"].items() for o in store)
    assert held == [("Job", "j-launcher"), ("Service", "j")]
    assert ("enqueue_job", "ns", "j") in wakes.calls


def test_a_pod_whose_job_label_is_taken_off_leaves_its_job_and_wakes_it():
    wakes = Wakes()
    cache = caches.PodCache(wakes)
    cache.observe("ADDED", obj("Pod", "j-worker-0"))
    assert [p["metadata"]["name"] for p in cache.ix["dtj_pods"][("ns", "j")]] == ["j-worker-0"]
    wakes.calls.clear()
    cache.observe("MODIFIED", obj("Pod", "j-worker-0", job=None))
    assert cache.ix["dtj_pods"] == {} and cache.held == {}
    assert ("enqueue_job", "ns", "j") in wakes.calls


def test_a_pod_deleted_before_it_was_ever_seen_still_wakes_its_job_with_its_last_state():
    wakes = Wakes()
    cache = caches.PodCache(wakes)
    cache.observe("DELETED", obj("Pod", "j-worker-1", status={"phase": "Failed"}))
    departed = [c for c in wakes.calls if c[0] == "pod_departed"]
    assert [(c[2], c[3]["status"]["phase"]) for c in departed] == [("j", "Failed")]
    assert ("wake_gate", "ns") in wakes.calls


def test_pods_of_no_interest_and_config_maps_not_the_jobs_are_not_held():
    wakes = Wakes()
    pods, children = caches.PodCache(wakes), caches.ChildCache(wakes)
    pods.observe("ADDED", obj("Pod", "someone-elses", job=None))
    children.observe("ADDED", obj("ConfigMap", "not-a-name-of-the-job"))
    assert pods.held == {} and children.held == {} and children.ix["dtj_children"] == {}
