"""Kueue's lifecycle of an admitted job, without a cluster: the pure decisions on the cached
Workload (kueue.stop_reason, requeue_patch, pods_ready_patch, place) and what jobsync.decide
does with them (stop and requeue on eviction, flavors onto the pods, PodsReady), plus
runPolicy.managedBy. tests/cluster/test_kueue.py drives the same with the real Kueue."""

from __future__ import annotations

import copy

import pytest

from tests.unit.test_jobsync_decide import (
    CFG,
    NOW,
    RUNNING,
    T0,
    UID,
    body,
    cond,
    launcher,
    pod,
    reasons,
    shared,
    snap,
    summary,
    workers,
)
from trainop import conditions, kueue
from trainop.actions import PatchStatus
from trainop.handlers import indexes
from trainop.jobsync import decide
from trainop.priority import Priority
from trainop.render import dtj as render
from trainop.spec import SpecError, parse

STAMP = "2026-05-01T12:00:00Z"
FLAVOR = {"metadata": {"name": "a100"}, "spec": {
    "nodeLabels": {"kubernetes.azure.com/accelerator": "nvidia", "gpu.sku": "a100"},
    "tolerations": [{"key": "sku", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}]}}
CPU_FLAVOR = {"metadata": {"name": "cpu"}, "spec": {}}


def workload(*conds: tuple, admission: bool = True, job: dict | None = None) -> dict:
    """The job's Workload as Kueue keeps it: the pod sets the operator created it with (of
    `job`, default the test's body), in the state `conds` say."""
    status: dict = {"conditions": []}
    for type_, status_, reason, *message in conds:
        status["conditions"] = conditions.set_condition(
            status["conditions"], type_, status_, reason, message[0] if message else "m",
            timestamp=T0)
    if admission:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "workers", "flavors": {"nvidia.com/gpu": "a100", "cpu": "a100"}},
            {"name": "launcher", "flavors": {"cpu": "cpu", "memory": "cpu"}}]}
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": "dtj-j", "namespace": "ns", "uid": "uid-wl",
                         "resourceVersion": "42", "generation": 1,
                         "ownerReferences": [{"controller": True, "uid": UID}]},
            "spec": kueue.render_workload(parse(job or body(queue="team"), CFG), "team")["spec"],
            "status": status}


ADMITTED_WL = (("QuotaReserved", True, "QuotaReserved"), ("Admitted", True, "Admitted"))
PREEMPTED = ("Evicted", True, "Preempted", "Preempted to accommodate a workload (UID: u) due "
                                           "to prioritization in the ClusterQueue")


def test_stop_reason_follows_the_workload():
    assert kueue.stop_reason(workload(*ADMITTED_WL)) is None
    reason, message = kueue.stop_reason(workload(*ADMITTED_WL, PREEMPTED))
    assert reason == "Preempted"
    assert message == ("Kueue evicted Workload dtj-j (Preempted): Preempted to accommodate a "
                       "workload (UID: u) due to prioritization in the ClusterQueue")
    assert kueue.stop_reason(workload(*ADMITTED_WL, ("Evicted", True, "PodsReadyTimeout",
                                                     "Exceeded the PodsReady timeout")))[0] \
        == "Evicted"
    assert kueue.stop_reason(workload(("QuotaReserved", False, "Pending", "no room"),
                                      ("Admitted", False, "NoReservation"), admission=False)) \
        == ("NotAdmitted", "Kueue no longer admits Workload dtj-j: no room")
    assert kueue.stop_reason(None)[0] == "WorkloadDeleted"


def test_requeue_patch_releases_the_quota_as_the_jobframework_does():
    assert kueue.requeue_patch(workload(*ADMITTED_WL), STAMP) is None  # not evicted
    wl = workload(*ADMITTED_WL, ("PodsReady", True, "Started"), PREEMPTED)
    patch = kueue.requeue_patch(wl, STAMP)
    assert patch["metadata"] == {"resourceVersion": "42"} and patch["status"]["admission"] is None
    got = {c["type"]: (c["status"], c["reason"]) for c in patch["status"]["conditions"]}
    assert got == {"QuotaReserved": ("False", "Pending"), "Admitted": ("False", "NoReservation"),
                   "PodsReady": ("False", "WaitForStart"), "Evicted": ("True", "Preempted"),
                   "Requeued": ("True", "Preempted")}
    assert all(c["lastTransitionTime"] == STAMP for c in patch["status"]["conditions"]
               if c["type"] != "Evicted")
    # released already (our patch landed): nothing more
    wl["status"]["conditions"] = patch["status"]["conditions"]
    assert kueue.requeue_patch(wl, STAMP) is None
    # an eviction that is not a preemption requeues with Requeued=False, as Kueue does
    other = kueue.requeue_patch(workload(*ADMITTED_WL, ("Evicted", True, "ClusterQueueStopped")),
                                STAMP)
    assert conditions.get_condition(other["status"]["conditions"], "Requeued")["status"] == "False"


@pytest.mark.parametrize("before, ready, expect", [
    (None, False, ("False", "WaitForStart")),
    (None, True, ("True", "Started")),
    (("PodsReady", True, "Started"), False, ("False", "WaitForRecovery")),
    (("PodsReady", False, "WaitForRecovery"), True, ("True", "Recovered")),
    (("PodsReady", True, "Started"), True, None),             # unchanged: no write
    (("PodsReady", False, "WaitForStart"), False, None),
])
def test_pods_ready_has_the_jobframework_reasons(before, ready, expect):
    wl = workload(*ADMITTED_WL, *([before] if before else []))
    patch = kueue.pods_ready_patch(wl, ready, STAMP)
    if expect is None:
        assert patch is None
    else:
        got = conditions.get_condition(patch["status"]["conditions"], "PodsReady")
        assert (got["status"], got["reason"]) == expect
    assert kueue.pods_ready_patch(workload(*ADMITTED_WL, PREEMPTED), True, STAMP) is None


def test_place_puts_each_pod_sets_flavor_on_its_pods():
    job = kueue.place(parse(body(), CFG), workload(*ADMITTED_WL), {"a100": FLAVOR, "cpu": CPU_FLAVOR})
    worker = render.render_worker(job, 0, 0)["spec"]
    assert worker["nodeSelector"] == {"kubernetes.azure.com/agentpool": "gpu", "kubernetes.azure.com/accelerator": "nvidia",
                                      "gpu.sku": "a100"}
    assert worker["tolerations"][-1] == FLAVOR["spec"]["tolerations"][0]
    assert len(worker["tolerations"]) == 2  # the pool's GPU toleration stays first
    launcher_pod = render.render_launcher(job, 0)["spec"]["template"]["spec"]
    assert launcher_pod["nodeSelector"] == {"kubernetes.azure.com/agentpool": "gpu"}  # its flavor adds nothing
    # a flavor without labels or tolerations changes nothing
    plain = parse(body(), CFG)
    assert kueue.place(plain, workload(*ADMITTED_WL), {"a100": CPU_FLAVOR, "cpu": CPU_FLAVOR}) is plain


def test_place_refuses_a_flavor_that_contradicts_the_pool_and_waits_for_an_unknown_one():
    job = parse(body(), CFG)
    wrong = {"metadata": {"name": "a100"}, "spec": {"nodeLabels": {"kubernetes.azure.com/agentpool": "ibgpu"}}}
    with pytest.raises(SpecError) as err:
        kueue.place(job, workload(*ADMITTED_WL), {"a100": wrong, "cpu": CPU_FLAVOR})
    assert str(err.value).startswith(
        "spec.nodePool.name: Kueue admitted pod set workers on ResourceFlavor a100, whose "
        "nodeLabels say kubernetes.azure.com/agentpool=ibgpu, but the job's nodeSelector says "
        "kubernetes.azure.com/agentpool=gpu")
    with pytest.raises(kueue.FlavorMissing):
        kueue.place(job, workload(*ADMITTED_WL), {"cpu": CPU_FLAVOR})


KUEUE_RUNNING = {**RUNNING, "conditions": cond(
    ("Created", True, "ChildrenCreated"), ("Admitted", True, "KueueAdmitted"),
    ("WorkersReady", True, "AllWorkersReady"), ("Running", True, "LauncherCreated"))}
FLAVORS = {"a100": FLAVOR, "cpu": CPU_FLAVOR}


def kueue_snap(status: dict, wl: dict | None, **kw):
    """A Kueue job's snapshot: admission comes from `wl` (kueue.decide), never the native gate."""
    return snap(body(copy.deepcopy(status), queue="team"), admit=None, kueue=True, workload=wl,
                flavors=FLAVORS, **shared(), **kw)


def test_an_evicted_gang_stops_queues_and_is_not_a_restart():
    wl = workload(*ADMITTED_WL, PREEMPTED)
    gang = workers() + [pod("j-launcher-abc", role="launcher", index=None)]
    out = decide(kueue_snap(KUEUE_RUNNING, wl, pods=gang, launcher=launcher()), CFG, NOW)
    assert summary(out.actions) == ["delete Pod j-worker-0", "delete Pod j-worker-1",
                                    "delete Pod j-launcher-abc", "delete Job j-launcher"]
    st = out.status
    assert st["phase"] == "Queued" and st["restarts"] == {"failures": 0, "disruptions": 0} and st["evictions"] == 1
    assert "startTime" not in st
    got = reasons(st)
    assert got["Evicted"] == ("True", "Preempted") and got["Admitted"] == ("False", "WaitingForKueue")
    assert got["Running"] == ("False", "Preempted") and "Restarting" not in got
    assert ("Warning", "Preempted") in [(t, r) for t, r, _ in out.events]
    assert conditions.get_condition(st["conditions"], "Evicted")["message"].endswith(
        "; the gang is stopped and the job waits in LocalQueue team to be admitted again")

    # the pods are going: still waiting, counted once
    going = decide(kueue_snap(st, wl, pods=workers(deleting=True)), CFG, NOW)
    assert going.actions == [] and going.status["evictions"] == 1
    assert going.waiting == "waiting for the evicted gang's pods to go"

    # gone: the quota is given back, and the job waits at the gate for Kueue
    gone = decide(kueue_snap(st, wl), CFG, NOW)
    patch = [a for a in gone.actions if isinstance(a, PatchStatus)]
    assert len(patch) == 1 and patch[0].ref.name == "dtj-j"
    assert patch[0].patch == kueue.requeue_patch(wl, "2026-05-01T12:00:00Z")
    assert gone.status["phase"] == "Queued" and reasons(gone.status)["Admitted"] == \
        ("False", "WaitingForKueue")

    # admitted again: the same attempt starts anew on its flavor
    again = workload(*ADMITTED_WL)
    back = decide(kueue_snap(gone.status, again), CFG, NOW)
    assert reasons(back.status)["Evicted"] == ("False", "Readmitted")
    made = [a.obj for a in back.actions if getattr(a, "obj", {}).get("kind") == "Pod"]
    assert [p["metadata"]["labels"]["trainop.io/attempt"] for p in made] == ["0", "0"]
    assert all(p["spec"]["nodeSelector"]["gpu.sku"] == "a100" for p in made)
    assert back.status["restarts"] == {"failures": 0, "disruptions": 0} and back.status["evictions"] == 1


def test_a_running_gang_reports_pods_ready_once():
    gang = workers() + [pod("j-launcher-abc", role="launcher", index=None)]
    wl = workload(*ADMITTED_WL)
    out = decide(kueue_snap(KUEUE_RUNNING, wl, pods=gang, launcher=launcher()), CFG, NOW)
    [patch] = [a for a in out.actions if isinstance(a, PatchStatus)]
    assert reasons(patch.patch["status"])["PodsReady"] == ("True", "Started")
    wl["status"]["conditions"] = patch.patch["status"]["conditions"]
    again = decide(kueue_snap(KUEUE_RUNNING, wl, pods=gang, launcher=launcher()), CFG, NOW)
    assert not [a for a in again.actions if isinstance(a, PatchStatus)]
    assert again.status == {**out.status}
    # still admitted by Kueue: nothing stops
    assert again.status["phase"] == "Running"


def test_a_job_managed_by_another_controller_gets_no_decision():
    b = body(runPolicy={"managedBy": "kueue.x-k8s.io/multikueue"}, queue="team")
    out = decide(snap(b), CFG, NOW)
    assert out.actions == [] and out.status is None and out.events == []
    assert out.waiting == "runPolicy.managedBy is kueue.x-k8s.io/multikueue: left to that controller"
    mine = decide(snap(body(runPolicy={"managedBy": "trainop.io/operator"})), CFG, NOW)
    assert mine.status["phase"] == "Starting"


def test_a_flavor_problem_fails_or_waits_before_the_start_and_never_stops_a_running_gang():
    wl = workload(*ADMITTED_WL)
    new = {"conditions": cond(("Created", True, "ChildrenCreated"))}
    conflict = {"a100": {"metadata": {"name": "a100"},
                         "spec": {"nodeLabels": {"kubernetes.azure.com/agentpool": "ibgpu"}}},
                "cpu": CPU_FLAVOR}
    s = kueue_snap(new, wl)
    s.flavors = conflict
    out = decide(s, CFG, NOW)
    assert out.status["phase"] == "Failed" and reasons(out.status)["Failed"] == \
        ("True", "FlavorConflict") and not summary(out.actions)
    s = kueue_snap(new, wl)
    s.flavors = {"cpu": CPU_FLAVOR}
    out = decide(s, CFG, NOW)
    assert reasons(out.status)["Created"] == ("False", "WaitingForResourceFlavor")
    assert out.waiting == "waiting for ResourceFlavor a100, which Kueue admitted the job on"
    s = kueue_snap(KUEUE_RUNNING, wl, pods=workers(), launcher=launcher())
    s.flavors = conflict
    assert decide(s, CFG, NOW).status["phase"] == "Running"


def test_a_flavor_contradicting_the_pod_template_fails_the_job_naming_the_template_field():
    """A nodeSelector from spec.podTemplate is the job's own too: a flavor that contradicts it
    fails the job at admission (FlavorConflict) instead of failing every render."""
    status = {"conditions": cond(("Created", True, "ChildrenCreated"))}
    s = kueue_snap(status, workload(*ADMITTED_WL))
    s.body["spec"]["podTemplate"] = {"worker": {"spec": {"nodeSelector": {"gpu.sku": "h100"}}}}
    out = decide(s, CFG, NOW)
    assert out.status["phase"] == "Failed" and reasons(out.status)["Failed"] == \
        ("True", "FlavorConflict") and not summary(out.actions)
    failed = conditions.get_condition(out.status["conditions"], "Failed")
    assert "spec.podTemplate.worker.spec.nodeSelector" in failed["message"]
    assert "gpu.sku=a100" in failed["message"] and "gpu.sku=h100" in failed["message"]


# ---- the Workload's lifecycle as actions of decide() (no API call inside it) ----------------

def test_a_job_without_a_workload_creates_one_and_makes_no_pod():
    out = decide(kueue_snap({}, None), CFG, NOW)
    assert summary(out.actions) == ["create Workload dtj-j"]
    [made] = [a.obj for a in out.actions]
    assert made == kueue.render_workload(parse(body(queue="team"), CFG), "team")
    assert out.status["phase"] == "Queued" and reasons(out.status)["Admitted"] == \
        ("False", "WaitingForKueue")


def test_a_queued_job_edited_after_its_workload_was_made_never_runs_on_the_old_admission():
    """Issue 22 H1: the Workload asked for 2 × 4 GPUs and Kueue admitted it; the job was edited
    to 16 × 8 meanwhile. No pod may be made: the Workload is replaced (finalizer dropped, then
    deleted) and the job queues again, for its new shape."""
    wl = workload(*ADMITTED_WL)  # made for body(queue="team"): 2 workers × 4 GPUs
    wl["metadata"]["finalizers"] = [kueue.FINALIZER]
    grown = body(None, generation=2, queue="team", workers=16, gpusPerWorker=8,
                 nodePool={"name": "ibgpu"})
    s = kueue_snap({}, wl)
    s.body = grown
    out = decide(s, CFG, NOW)
    assert summary(out.actions) == ["set finalizers Workload dtj-j []", "delete Workload dtj-j"]
    assert out.status["phase"] == "Queued" and "Created" not in reasons(out.status)
    assert "workers×16" in out.waiting and "workers×2" in out.waiting
    # the old Workload is going: still nothing, whatever Kueue says of it
    wl["metadata"]["deletionTimestamp"] = T0
    going = decide(kueue_snap({}, wl), CFG, NOW)
    assert going.actions == [] and going.waiting == "waiting for Workload dtj-j to be deleted"
    # gone: a Workload of the new shape queues
    s = kueue_snap({}, None)
    s.body = grown
    new = decide(s, CFG, NOW)
    [made] = [a.obj for a in new.actions]
    assert [(p["name"], p["count"]) for p in made["spec"]["podSets"]] == [("workers", 16), ("launcher", 1)]
    assert made["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"][
        "limits"]["nvidia.com/gpu"] in ("8", 8)


def test_an_admitted_workload_of_the_same_shape_is_kept():
    out = decide(kueue_snap({}, workload(*ADMITTED_WL)), CFG, NOW)
    assert reasons(out.status)["Admitted"] == ("True", "KueueAdmitted")
    assert any(a.obj["kind"] == "Pod" for a in out.actions if hasattr(a, "obj"))


def test_a_finished_job_gives_its_quota_back_only_when_no_pod_holds_gpus():
    """Issue 22 M10: with cleanPodPolicy None a worker keeps running after the job succeeded;
    the Workload stays (its GPUs are still held) until no pod of the job is active."""
    wl = workload(*ADMITTED_WL)
    wl["metadata"]["finalizers"] = [kueue.FINALIZER]
    done = {**KUEUE_RUNNING, "phase": "Succeeded", "completionTime": T0, "cleanedUp": True,
            "conditions": KUEUE_RUNNING["conditions"] + cond(("Succeeded", True, "m"))}
    running_worker = workers()[:1]
    held = decide(kueue_snap(done, wl, pods=running_worker), CFG, NOW)
    assert not [a for a in held.actions if "Workload" in str(getattr(a, "ref", ""))]
    free = decide(kueue_snap(done, wl), CFG, NOW)
    [patch] = free.actions
    assert isinstance(patch, PatchStatus) and reasons(patch.patch["status"])["Finished"] == \
        ("True", "Succeeded")
    wl["status"]["conditions"] = patch.patch["status"]["conditions"]
    assert summary(decide(kueue_snap(done, wl), CFG, NOW).actions) == \
        ["set finalizers Workload dtj-j []"]


def test_a_suspended_job_releases_its_workload_only_once_its_pods_are_gone():
    wl = workload(*ADMITTED_WL)
    s = kueue_snap(KUEUE_RUNNING, wl, pods=workers(deleting=True))
    s.body["spec"]["runPolicy"] = {"suspend": True}
    going = decide(s, CFG, NOW)
    assert going.actions == [] and going.waiting == "waiting for the suspended gang's pods to go"
    s = kueue_snap(going.status, wl)
    s.body["spec"]["runPolicy"] = {"suspend": True}
    assert summary(decide(s, CFG, NOW).actions) == ["delete Workload dtj-j"]


def test_the_workload_as_the_cache_keeps_it_still_matches_its_job():
    """The index slims a Workload (handlers/indexes.slim_workload): what kueue.mismatch compares
    must survive it, or every job would replace its Workload forever (seen on the real Kueue
    before the pod sets were kept)."""
    job = parse(body(queue="team", resources={"requests": {"cpu": "2"}}), CFG)
    made = kueue.render_workload(job, "team")
    made["metadata"].update(uid="u", resourceVersion="1")
    cached = indexes.slim_workload(made)
    assert kueue.mismatch(job, Priority(0), cached) is None
    grown = parse(body(queue="team", workers=3, resources={"requests": {"cpu": "2"}}), CFG)
    assert "workers×3" in kueue.mismatch(grown, Priority(0), cached)
    more_cpu = parse(body(queue="team", resources={"requests": {"cpu": "3"}}), CFG)
    assert kueue.mismatch(more_cpu, Priority(0), cached) is not None
