"""gate.py over a namespace view (what the caches hold): who asks, who is admitted, who wakes."""

from __future__ import annotations

import pytest

from trainop import conditions, config, gate
from trainop.devcluster.pools import default_pools
from trainop.spec import parse

CFG = config.from_dict({"limits": {"namespaceGpus": 8}})
NODES = [n for pool in default_pools() for n in pool.nodes()]


G = gate.Gate()


@pytest.fixture(autouse=True)
def fresh_gate():
    global G
    G = gate.Gate()


def body(name: str, created: str, status: dict | None = None) -> dict:
    return {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
            "metadata": {"name": name, "namespace": "q", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created},
            "spec": {"workers": 2, "gpusPerWorker": 4}, "status": status or {}}


class View:
    """The namespace's view as the controller reads it from its caches, anew per reconcile."""

    def __init__(self, jobs, pods=()):
        self.jobs, self.pods = jobs, list(pods)

    def __call__(self) -> gate.NamespaceView:
        return gate.NamespaceView(pods=self.pods, quotas=[], jobs=self.jobs, nodes=NODES)


def test_first_come_is_admitted_the_second_waits_and_is_woken_when_room_appears():
    a, b = body("a", "2026-01-01T00:00:00Z"), body("b", "2026-01-01T00:00:01Z")
    view = View([a, b])
    assert G.decide(parse(a, CFG), a, CFG, view()).admitted
    second = G.decide(parse(b, CFG), b, CFG, view())
    assert not second.admitted and second.reason == "QuotaExceeded"
    assert G.wake("q") == ["b"]  # a finished or went: b's reconcile judges again
    a["status"] = {"phase": "Succeeded"}
    assert G.decide(parse(b, CFG), b, CFG, view()).admitted


def test_a_job_admitted_here_is_not_admitted_twice_before_its_status_says_so():
    a, b = body("a", "2026-01-01T00:00:00Z"), body("b", "2026-01-01T00:00:01Z")
    view = View([a, b])
    G.decide(parse(a, CFG), a, CFG, view())  # admitted; its status not written yet
    G.wake("q")  # anything that makes the queue be judged again
    assert not G.decide(parse(b, CFG), b, CFG, view()).admitted


def test_a_view_read_before_an_admitted_job_reached_the_caches_cannot_admit_into_its_room():
    """Seen in test_pools under load: `never` read its view while `next` was not yet in the
    job cache; `next` asked first and was admitted; `never` then judged with its older view,
    which did not show `next`, and was admitted too (16 GPUs under a cap of 8). The admitted
    job's demand is held until a view shows it ended or the job is deleted."""
    never, nxt = body("never", "2026-01-01T00:00:00Z"), body("next", "2026-01-01T00:00:01Z")
    assert G.decide(parse(nxt, CFG), nxt, CFG, View([never, nxt])()).admitted  # never not asking yet
    late = G.decide(parse(never, CFG), never, CFG, View([never])())  # read before `next` was cached
    assert not late.admitted and late.reason == "QuotaExceeded"
    G.wake("q")
    assert not G.decide(parse(never, CFG), never, CFG, View([never])()).admitted  # still held
    G.forget("q", "next")  # deleted
    G.wake("q")
    assert G.decide(parse(never, CFG), never, CFG, View([never])()).admitted


def test_an_admitted_job_that_ended_lets_go_of_its_room():
    a, b = body("a", "2026-01-01T00:00:00Z"), body("b", "2026-01-01T00:00:01Z")
    assert G.decide(parse(a, CFG), a, CFG, View([a, b])()).admitted
    assert not G.decide(parse(b, CFG), b, CFG, View([a, b])()).admitted
    a["status"] = {"phase": "Failed"}
    G.wake("q")
    assert G.decide(parse(b, CFG), b, CFG, View([a, b])()).admitted


def test_a_waiting_job_does_not_judge_the_queue_again_until_woken(monkeypatch):
    a, b = body("a", "2026-01-01T00:00:00Z"), body("b", "2026-01-01T00:00:01Z")
    view = View([a, b])
    judged = []
    evaluate = gate._evaluate
    monkeypatch.setattr(gate, "_evaluate", lambda *args: judged.append(1) or evaluate(*args))
    G.decide(parse(a, CFG), a, CFG, view())
    G.decide(parse(b, CFG), b, CFG, view())
    assert len(judged) == 2  # each asked for the first time
    G.decide(parse(b, CFG), b, CFG, view())  # a safety resync, a child event: no re-judging
    assert len(judged) == 2
    G.wake("q")
    G.decide(parse(b, CFG), b, CFG, view())
    assert len(judged) == 3


def test_a_view_read_before_a_wake_does_not_mark_the_queue_judged():
    """A reconcile reads its view, then room appears (wake), then it judges with the old view:
    the next job must judge again with a view that has the room (this raced under load: the
    large job stayed queued with its quota free)."""
    a, b = body("a", "2026-01-01T00:00:00Z"), body("b", "2026-01-01T00:00:01Z")
    G.decide(parse(a, CFG), a, CFG, View([a, b])())  # a runs
    assert not G.decide(parse(b, CFG), b, CFG, View([a, b])()).admitted
    stale = gate.NamespaceView(pods=[], quotas=[], jobs=[a, b], nodes=NODES, wakes=G.wakes("q"))
    a["status"] = {"phase": "Succeeded"}
    assert G.wake("q") == ["b"]
    a_running = {**a, "status": {}}  # what the stale view still holds
    stale.jobs = [a_running, b]
    assert not G.decide(parse(b, CFG), b, CFG, stale).admitted
    fresh = gate.NamespaceView(pods=[], quotas=[], jobs=[a, b], nodes=NODES, wakes=G.wakes("q"))
    assert G.decide(parse(b, CFG), b, CFG, fresh).admitted


def test_a_namespace_nothing_limits_judges_each_job_alone(monkeypatch):
    free = config.from_dict(None)  # no namespaceGpus cap, and the view has no quota
    monkeypatch.setattr(gate, "_evaluate", lambda *args: pytest.fail("judged the namespace"))
    a = body("a", "2026-01-01T00:00:00Z")
    assert G.decide(parse(a, free), a, free, View([a])()).admitted
    huge = {**body("h", "2026-01-01T00:00:00Z"), "spec": {"workers": 5, "gpusPerWorker": 8,
                                                           "nodePool": {"name": "gpu"}}}
    no = G.decide(parse(huge, free), huge, free, View([huge])())
    assert no.outcome == "Unsatisfiable" and "node pool 'gpu' has 16 in all" in no.message


def test_jobs_another_evaluation_admitted_are_handed_out_once():
    a = body("a", "2026-01-01T00:00:00Z",
             {"conditions": conditions.set_condition([], "Admitted", False, "QuotaExceeded", "m")})
    b = body("b", "2026-01-01T00:00:01Z")
    view = View([a, b])
    G.decide(parse(b, CFG), b, CFG, view())  # b asks first; a (queued earlier) is judged too
    assert G.drain_admitted("q") == ["a"]
    assert G.drain_admitted("q") == []


def test_wake_without_waiting_jobs_wakes_nobody():
    assert G.wake("nobody-asked") == []


def test_a_job_edited_to_a_malformed_account_url_does_not_stop_the_namespaces_queue():
    """Issue 22 L1: an admitted job's spec is parsed each time the queue is judged; a ValueError
    from its accountURL's port once broke admission for every job of the namespace."""
    a, b = body("a", "2026-01-01T00:00:00Z"), body("b", "2026-01-01T00:00:01Z")
    view = View([a, b])
    assert G.decide(parse(a, CFG), a, CFG, view()).admitted
    a["spec"]["output"] = {"blob": {"accountURL": "https://acct.blob.core.windows.net:abc", "container": "logs",
                                    "auth": {"sasSecretRef": {"name": "s", "key": "k"}}}}
    G.wake("q")
    assert G.decide(parse(b, CFG), b, CFG, view()).admitted  # a is judged by jobsync (InvalidSpec)
