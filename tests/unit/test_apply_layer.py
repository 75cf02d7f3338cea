"""apply.py against a fake API (what each action costs in requests) and workqueue.py."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes.client.exceptions import ApiException

from trainop import apply, kube
from trainop.actions import Apply, Create, Delete, Ref, force_delete
from trainop.workqueue import WorkQueue

OWNER = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
         "metadata": {"name": "j", "namespace": "ns", "uid": "u1"}}
SERVICE = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "j", "namespace": "ns", "labels": {"trainop.io/job-name": "j"}},
           "spec": {"clusterIP": "None", "selector": {"trainop.io/job-name": "j"}}}


class FakeApi:
    def __init__(self):
        self.objects: dict[tuple, dict] = {}
        self.calls: list[str] = []
        self.version = 0

    def _stamp(self, obj):
        self.version += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        ref = Ref.of(obj)
        self.objects[(ref.kind, ref.namespace, ref.name)] = obj
        return obj

    def create(self, obj):
        self.calls.append("create")
        ref = Ref.of(obj)
        if (ref.kind, ref.namespace, ref.name) in self.objects:
            raise ApiException(status=409)
        return self._stamp(obj)

    def apply(self, obj):
        self.calls.append("apply")
        return self._stamp(obj)

    def get(self, api_version, kind, name, namespace=None):
        self.calls.append("get")
        return self.objects.get((kind, namespace, name))

    def delete(self, api_version, kind, name, namespace=None, **_):
        self.calls.append("delete")
        return self.objects.pop((kind, namespace, name), None) is not None


@pytest.fixture
def api(monkeypatch):
    fake = FakeApi()
    for name in ("create", "apply", "get", "delete"):
        monkeypatch.setattr(kube, name, getattr(fake, name))
    return fake


def test_apply_creates_a_missing_child_then_costs_nothing_until_it_drifts(api):
    applier = apply.Applier()
    assert applier.run([Apply(SERVICE, OWNER, "")]) == []
    assert api.calls == ["create"]
    live = api.objects[("Service", "ns", "j")]
    assert live["metadata"]["ownerReferences"][0]["uid"] == "u1"
    version = live["metadata"]["resourceVersion"]
    applier.run([Apply(SERVICE, OWNER, version)])  # the watch shows our own write
    assert api.calls == ["create"]
    applier.run([Apply(SERVICE, OWNER, "edited-by-someone")])  # drift: server-side apply
    assert api.calls == ["create", "apply"]


def test_a_changed_rendering_is_applied(api):
    applier = apply.Applier()
    applier.run([Apply(SERVICE, OWNER, "")])
    version = api.objects[("Service", "ns", "j")]["metadata"]["resourceVersion"]
    changed = {**SERVICE, "spec": {**SERVICE["spec"], "ports": [{"port": 22}]}}
    applier.run([Apply(changed, OWNER, version)])
    assert api.calls == ["create", "apply"]


def test_unwatched_kinds_are_applied_once_per_rendering(api):
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "j-logship", "namespace": "ns"}, "rules": []}
    applier = apply.Applier()
    applier.run([Apply(role, OWNER, None)])
    applier.run([Apply(role, OWNER, None)])
    assert api.calls == ["create"]


def test_a_name_taken_by_someone_else_is_a_conflict_never_adopted(api):
    api.objects[("Service", "ns", "j")] = {**SERVICE, "metadata": {**SERVICE["metadata"],
                                                                   "ownerReferences": []}}
    conflicts = apply.Applier().run([Apply(SERVICE, OWNER, "")])
    assert conflicts and conflicts[0].reason == "NameConflict"
    assert "not controlled by DistributedTrainingJob j" in conflicts[0].message
    assert "apply" not in api.calls
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j", "namespace": "ns"}}
    api.objects[("Pod", "ns", "j")] = pod
    assert apply.Applier().run([Create(pod, OWNER)])


def test_create_of_our_own_existing_child_is_fine(api):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", "namespace": "ns"}}
    applier = apply.Applier()
    assert applier.run([Create(pod, OWNER)]) == []
    assert applier.run([Create(pod, OWNER)]) == []  # a stale cache asked twice: a 409, no error
    assert api.calls == ["create", "create", "get"]


def test_a_jobs_created_pods_are_remembered_until_seen_and_nothing_else_is(api):
    applier = apply.Applier()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", "namespace": "ns", "uid": "p1"}}
    stage = {**OWNER, "kind": "DataStage", "metadata": {**OWNER["metadata"], "uid": "s1"}}
    copy_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "c", "namespace": "ns"}}
    assert applier.run([Create(pod, OWNER), Create(copy_job, stage), Create(SERVICE, OWNER)]) == []
    assert [p["metadata"]["name"] for p in applier.created("u1", "Pod", [])] == ["w"]
    assert applier.created("u1", "Service", []) == [] and applier.created("s1", "Job", []) == []
    assert applier._created.keys() == {"u1"}  # (the copy Job was never remembered)
    live = api.objects[("Pod", "ns", "w")]
    applier.seen("Pod", {**live, "metadata": {**live["metadata"], "uid": "another"}})
    assert applier.created("u1", "Pod", []) != []  # an event of another incarnation
    applier.seen("Pod", live)
    assert applier.created("u1", "Pod", []) == [] and applier._created == {}


def test_delete_is_by_uid(api, monkeypatch):
    seen = []
    monkeypatch.setattr(kube, "delete", lambda *a, **kw: seen.append((a, kw)))
    apply.Applier().run([Delete(Ref("v1", "Pod", "w", "ns", "uid-w")),
                         Delete(Ref("v1", "Pod", "x", "ns", "uid-x"), grace_seconds=75)])
    assert seen == [(("v1", "Pod", "w", "ns"), {"uid": "uid-w", "grace_seconds": None}),
                    (("v1", "Pod", "x", "ns"), {"uid": "uid-x", "grace_seconds": 75})]


def test_force_delete_is_by_uid_with_grace_zero(api, monkeypatch):
    seen = []
    monkeypatch.setattr(kube, "delete", lambda *a, **kw: seen.append((a, kw)))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", "namespace": "ns", "uid": "uid-w"}}
    apply.Applier().run([force_delete(pod)])
    assert seen == [(("v1", "Pod", "w", "ns"), {"uid": "uid-w", "grace_seconds": 0})]


# ---- the work queue ----------------------------------------------------------------------

def test_queue_coalesces_and_never_hands_one_key_to_two_workers():
    async def main():
        q = WorkQueue()
        q.add("a")
        q.add("a")
        q.add("b")
        assert len(q) == 2
        first = await q.get()
        q.add(first)  # changed while processed: queued again, but only after done()
        second = await q.get()
        assert (first, second) == ("a", "b")
        q.done(first)
        assert await asyncio.wait_for(q.get(), 1) == "a"
    asyncio.run(main())


def test_queue_keeps_the_earliest_deadline():
    async def main():
        q = WorkQueue()
        q.add_after("a", 10)
        q.add_after("a", 0.01)
        q.add_after("a", 5)
        assert await asyncio.wait_for(q.get(), 1) == "a"
        q.add_after("b", 0.01)
        q.forget("b")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(q.get(), 0.1)
    asyncio.run(main())


def test_an_unwatched_child_deleted_or_edited_is_applied_again(api):
    """A watch event of a child decide() does not read (observe()): deleted, or changed past the
    version our apply returned, it is applied again; our own write's event changes nothing."""
    applier, role = apply.Applier(), {**SERVICE, "kind": "Role"}
    applier.run([Apply(role, OWNER, None)])
    ours = api.objects[("Role", "ns", "j")]
    applier.observe(ours, deleted=False)  # the event of our own apply
    applier.run([Apply(role, OWNER, None)])
    assert api.calls == ["create"]
    api.objects.pop(("Role", "ns", "j"))
    applier.observe(ours, deleted=True)
    applier.run([Apply(role, OWNER, None)])
    assert api.calls == ["create", "create"] and ("Role", "ns", "j") in api.objects
    edited = api._stamp(api.objects[("Role", "ns", "j")])  # someone else's write: a newer version
    applier.observe(edited, deleted=False)
    applier.run([Apply(role, OWNER, None)])
    assert api.calls[2:] == ["create", "get", "apply"]  # (409: ours, so applied over)


def test_the_ssh_secret_is_read_again_before_a_gang_start_and_made_again_if_gone(api, monkeypatch):
    """Never watched: read (one GET per gang start, none at rest) when pods are about to be
    created; a deleted one is made again before them."""
    from trainop import config, sshkeys
    from trainop.actions import CreateSSHSecret
    from trainop.spec import parse
    monkeypatch.setattr(sshkeys, "generate", lambda: ("private", "public"))
    job = parse({**OWNER, "spec": {"workers": 2, "gpusPerWorker": 1}}, config.from_dict({}))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j-worker-0", "namespace": "ns"}}
    pods = [Create(pod, OWNER), Create({**pod, "metadata": {**pod["metadata"], "name": "j-worker-1"}}, OWNER)]
    applier = apply.Applier()
    applier.run([CreateSSHSecret(job, OWNER)])
    assert applier.has_ssh_secret("u1") and api.calls == ["create"]
    applier.run(pods)
    assert api.calls[1:] == ["create", "create"]  # just made: the first gang reads nothing
    for name in ("j-worker-0", "j-worker-1"):
        api.objects.pop(("Pod", "ns", name))
    applier.run(pods)  # a restart: one read for the gang, there
    assert api.calls[3:] == ["get", "create", "create"]
    api.objects.pop(("Secret", "ns", "j-ssh"))  # someone deletes it
    for name in ("j-worker-0", "j-worker-1"):
        api.objects.pop(("Pod", "ns", name))
    applier.run(pods)  # the next restart
    assert api.calls[6:] == ["get", "create", "create", "create"] and ("Secret", "ns", "j-ssh") in api.objects


def test_a_write_is_refused_by_the_fence_before_it_is_sent(monkeypatch):
    sent = []
    monkeypatch.setattr(kube, "configure", lambda *a, **k: sent.append(a) or None)
    kube.fence(lambda: False)
    try:
        with pytest.raises(kube.NotLeading):
            kube.request("PATCH", "/api/v1/namespaces/ns/pods/p", body={})
        with pytest.raises(kube.NotLeading):
            kube.request("POST", "/api/v1/namespaces/ns/events", body={})
        assert sent == []  # nothing reached the client
    finally:
        kube.fence(lambda: True)


def _obj(kind: str, name: str) -> dict:
    return {"apiVersion": "batch/v1" if kind == "Job" else "v1", "kind": kind,
            "metadata": {"name": name, "namespace": "ns"}}


def test_stages_group_what_pods_need_then_the_pods_and_keep_the_rest_in_order():
    netpol, svc, cm = (Apply(_obj(k, "j"), OWNER) for k in ("NetworkPolicy", "Service", "ConfigMap"))
    w0, w1 = (Create(_obj("Pod", f"j-worker-{i}"), OWNER) for i in range(2))
    launcher = Create(_obj("Job", "j-launcher"), OWNER)
    d0, d1 = Delete(Ref("v1", "Pod", "j-worker-0", "ns")), Delete(Ref("batch/v1", "Job", "j-launcher", "ns"))
    assert apply.stages([netpol, svc, cm, w0, w1]) == [[netpol, svc, cm], [w0, w1]]
    assert apply.stages([netpol, svc, cm, launcher]) == [[netpol, svc, cm], [launcher]]
    # deletes keep their order (pods before their launcher Job), one at a time
    assert apply.stages([d0, d1, netpol]) == [[d0], [d1], [netpol]]
    assert apply.stages([w0, netpol, w1]) == [[w0], [netpol], [w1]]


def test_a_refused_child_stops_the_stages_after_it(api, monkeypatch):
    """The Service refused as invalid: its stage's siblings were tried, no pod is created."""
    real = api.create

    def create(obj):
        if obj["kind"] == "Service":
            api.calls.append("create")
            raise ApiException(status=422, reason="Invalid")
        return real(obj)

    monkeypatch.setattr(kube, "create", create)
    actions = [Apply(_obj("NetworkPolicy", "j"), OWNER, live_version=""), Apply(SERVICE, OWNER, live_version=""),
               Create(_obj("Pod", "j-worker-0"), OWNER), Create(_obj("Pod", "j-worker-1"), OWNER)]
    problems = apply.Applier().run(actions)
    assert [p.reason for p in problems] == ["ChildRejected"]
    assert "Service" in problems[0].message
    assert sorted(k for k, _, _ in api.objects) == ["NetworkPolicy"]  # and no Pod


def test_a_workload_that_makes_pods_waits_for_what_they_need_and_a_binding_for_its_role():
    sa, sts = Apply(_obj("ServiceAccount", "s"), OWNER), Apply({**_obj("StatefulSet", "s"), "apiVersion": "apps/v1"}, OWNER)
    assert apply.stages([sa, sts]) == [[sa], [sts]]
    role, binding = (Apply({**_obj(k, "s"), "apiVersion": "rbac.authorization.k8s.io/v1"}, OWNER)
                     for k in ("Role", "RoleBinding"))
    assert apply.stages([sa, role, binding, sts]) == [[sa, role], [binding], [sts]]
