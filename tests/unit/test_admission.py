"""admission.py: quota counting as the API server does it, the queue order with reservations,
and the Unsatisfiable judgement, each with explicit expected values (no API server)."""

from decimal import Decimal

import pytest

from trainop import admission, config, kueue
from trainop.admission import ADMITTED, QUEUED, UNSATISFIABLE
from trainop.devcluster.pools import default_pools
from trainop.spec import parse

CFG = config.from_dict(None)
NODES = [n for pool in default_pools() for n in pool.nodes()]  # gpu: 4x4 GPUs, ibgpu: 4x8
D = Decimal


def job(name="a", workers=2, gpus=4, launcher="mpi", **spec):
    body = {"metadata": {"name": name, "namespace": "team-a"},
            "spec": {"workers": workers, "gpusPerWorker": gpus, "launcher": launcher,
                     "data": {"synthetic": True}, **spec}}
    return parse(body, CFG)


def cand(name, created="2026-01-01T00:00:00Z", priority=0, live=(), admitted=False, **kw):
    return admission.candidate(job(name, **kw), {"creationTimestamp": created}, list(live),
                               admitted, priority)


def gpu_quota(hard, used=0, name="gpu", **more):
    return {"metadata": {"name": name},
            "spec": {"hard": {"requests.nvidia.com/gpu": str(hard), **more}},
            "status": {"used": {"requests.nvidia.com/gpu": str(used)}}}


def ledgers(*quotas, pods=(), cfg=CFG):
    return admission.ledgers("team-a", list(quotas), list(pods), cfg, {"nvidia.com/gpu"})


def running_pod(name, gpus, phase="Running", job_name=None):
    return {"metadata": {"name": name, "labels": {"trainop.io/job-name": job_name or "x",
                                                  "trainop.io/role": "worker"}},
            "spec": {"containers": [{"name": "w", "resources": {
                "limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


# ---- counting ----------------------------------------------------------------------------

def test_pod_usage_counts_requests_limits_and_defaults_requests_to_limits():
    pod = {"spec": {"containers": [
        {"name": "a", "resources": {"requests": {"cpu": "2", "memory": "4Gi"},
                                    "limits": {"memory": "8Gi", "nvidia.com/gpu": "4",
                                               "rdma/ib": "1"}}}]}}
    assert admission.pod_usage(pod) == {
        "pods": D(1), "count/pods": D(1),
        "requests.cpu": D(2), "cpu": D(2),
        "requests.memory": D(4 * 2 ** 30), "memory": D(4 * 2 ** 30),
        "requests.nvidia.com/gpu": D(4), "requests.rdma/ib": D(1),
        "limits.memory": D(8 * 2 ** 30), "limits.nvidia.com/gpu": D(4), "limits.rdma/ib": D(1),
    }


def test_pod_usage_adds_native_sidecars_and_takes_the_largest_init_container():
    pod = {"spec": {
        "initContainers": [
            {"name": "sidecar", "restartPolicy": "Always",
             "resources": {"requests": {"cpu": "50m", "memory": "96Mi"}}},
            {"name": "setup", "resources": {"requests": {"cpu": "3"}}}],
        "containers": [{"name": "main", "resources": {"requests": {"cpu": "1",
                                                                   "memory": "1Gi"}}}]}}
    usage = admission.pod_usage(pod)
    # containers + sidecar = 1.05 cpu; setup runs beside the sidecar: 3.05 cpu, the larger.
    assert usage["requests.cpu"] == D("3.050")
    assert usage["requests.memory"] == D(2 ** 30 + 96 * 2 ** 20)


def test_gang_demand_is_every_worker_plus_the_launcher():
    pods = admission.gang_pods(job(workers=3, gpus=4))
    assert [p["metadata"].get("name") for p in pods] == ["a-worker-0", "a-worker-1",
                                                         "a-worker-2", None]
    total = {}
    for p in pods:
        for k, v in admission.pod_usage(p).items():
            total[k] = total.get(k, 0) + v
    assert total["requests.nvidia.com/gpu"] == 12 and total["pods"] == 4
    assert total["requests.cpu"] == D("0.5")  # the launcher's request (config default)
    assert len(admission.gang_pods(job(launcher="torchrun", workers=3))) == 3


def test_a_launcher_that_runs_ranks_counts_its_gpus_and_one_of_the_users_own_its_resources():
    def usage(j):
        total = {}
        for p in admission.gang_pods(j):
            for k, v in admission.pod_usage(p).items():
                total[k] = total.get(k, 0) + v
        return total
    assert usage(job(workers=3, gpus=4, mpirun={"runLauncherAsWorker": True}))["requests.nvidia.com/gpu"] == 16
    own = usage(job(workers=3, gpus=4, mpirun={"resources": {"requests": {"cpu": "4", "memory": "8Gi"}}}))
    assert own["requests.nvidia.com/gpu"] == 12 and own["requests.cpu"] == D("4")


def test_infiniband_jobs_count_the_rdma_resource():
    pods = admission.gang_pods(job(workers=2, gpus=8, infiniband=True))
    assert sum(admission.pod_usage(p).get("requests.rdma/ib", 0) for p in pods) == 2


def test_outstanding_leaves_out_pods_already_counted():
    live = [running_pod("a-worker-0", 4, job_name="a"),
            running_pod("a-worker-1", 4, phase="Failed", job_name="a")]  # finished: not counted
    names = [p["metadata"].get("name") for p in admission.outstanding(job(), live)]
    assert names == ["a-worker-1", None]


def test_show_writes_quantities_as_people_do():
    assert admission.show(D(16), "requests.nvidia.com/gpu") == "16"
    assert admission.show(D("0.5"), "requests.cpu") == "500m"
    assert admission.show(D(536870912), "requests.memory") == "512Mi"
    assert admission.show(D(3 * 2 ** 30), "limits.memory") == "3Gi"


# ---- decisions -----------------------------------------------------------------------------

def test_the_issue_example_message():
    out = admission.plan([cand("big", workers=4, gpus=4)], ledgers(gpu_quota(24, used=16)), NODES)
    assert out["big"] == admission.Decision(
        QUEUED, "QuotaExceeded", "needs 16 nvidia.com/gpu; 8 of 24 free in ResourceQuota team-a/gpu")


def test_two_jobs_where_the_quota_fits_one():
    out = admission.plan([cand("first", created="2026-01-01T00:00:00Z"),
                          cand("second", created="2026-01-01T00:00:05Z")],
                         ledgers(gpu_quota(8)), NODES)
    assert out["first"].outcome == ADMITTED and out["first"].reason == "QuotaReserved"
    assert out["second"] == admission.Decision(
        QUEUED, "QuotaExceeded", "needs 8 nvidia.com/gpu; 0 of 8 free in ResourceQuota team-a/gpu")


def test_an_admitted_job_holds_what_it_has_not_created_yet():
    # "first" was admitted a moment ago and has one of its two workers so far: the quota's
    # used shows 4, and the other 4 are still its own.
    first = cand("first", admitted=True, live=[running_pod("first-worker-0", 4, job_name="first")])
    out = admission.plan([first, cand("second")], ledgers(gpu_quota(12, used=4)), NODES)
    assert "first" not in out
    assert out["second"] == admission.Decision(
        QUEUED, "QuotaExceeded", "needs 8 nvidia.com/gpu; 4 of 12 free in ResourceQuota team-a/gpu")
    out = admission.plan([first, cand("second", workers=1)], ledgers(gpu_quota(12, used=4)), NODES)
    assert out["second"].outcome == ADMITTED


def test_a_quota_status_that_trails_the_pods_counts_the_pods():
    # The quota controller recounts after a deletion from its own informer and can write a
    # used that misses a pod created a moment before (seen in CI: "4 of 8 free" while both
    # of a running job's 4-GPU workers existed). The live pods we see count as well.
    live = [running_pod(f"second-worker-{i}", 4, job_name="second") for i in range(2)]
    out = admission.plan([cand("first")], ledgers(gpu_quota(8, used=4), pods=live), NODES)
    assert out["first"] == admission.Decision(
        QUEUED, "QuotaExceeded", "needs 8 nvidia.com/gpu; 0 of 8 free in ResourceQuota team-a/gpu")
    # ... and a status ahead of our pods (other pods in the namespace) still counts in full;
    # finished pods count in neither.
    done = [running_pod("old-worker-0", 4, phase="Succeeded", job_name="old")]
    out = admission.plan([cand("first", workers=1)],
                         ledgers(gpu_quota(8, used=4), pods=done), NODES)
    assert out["first"].outcome == ADMITTED
    out = admission.plan([cand("first", workers=1)],
                         ledgers(gpu_quota(8, used=6), pods=live[:1]), NODES)
    assert out["first"] == admission.Decision(
        QUEUED, "QuotaExceeded", "needs 4 nvidia.com/gpu; 2 of 8 free in ResourceQuota team-a/gpu")


def test_priority_beats_arrival_order():
    out = admission.plan([cand("early-low", created="2026-01-01T00:00:00Z", priority=0),
                          cand("late-high", created="2026-01-01T00:01:00Z", priority=10)],
                         ledgers(gpu_quota(8)), NODES)
    assert out["late-high"].outcome == ADMITTED and out["early-low"].outcome == QUEUED


def test_fifo_within_a_priority_then_name():
    order = admission.order([cand("b", created="2026-01-01T00:00:01Z"),
                             cand("c", created="2026-01-01T00:00:00Z"),
                             cand("a", created="2026-01-01T00:00:01Z"),
                             cand("z", created="2026-01-01T00:00:09Z", priority=1)])
    assert [c.key for c in order] == ["z", "c", "a", "b"]


def test_small_jobs_behind_a_large_one_cannot_take_what_it_waits_for():
    # 8 of 16 GPUs free: the large job (16) waits; four small ones (4 each) would fit the 8
    # free GPUs, but every one of them would delay the large job, so they wait behind it.
    cands = [cand("large", workers=4, gpus=4, created="2026-01-01T00:00:00Z")]
    cands += [cand(f"small{i}", workers=1, gpus=4, created=f"2026-01-01T00:00:0{i + 1}Z")
              for i in range(4)]
    cands.append(cand("cpu-only", workers=1, gpus=0, created="2026-01-01T00:00:09Z"))
    out = admission.plan(cands, ledgers(gpu_quota(16, used=8)), NODES)
    assert out["large"].outcome == QUEUED
    assert out["large"].message == "needs 16 nvidia.com/gpu; 8 of 16 free in ResourceQuota team-a/gpu"
    for i in range(4):
        assert out[f"small{i}"].outcome == QUEUED
    assert out["small0"].message == (
        "needs 4 nvidia.com/gpu; 8 of 16 free in ResourceQuota team-a/gpu, 16 of it held for "
        "jobs ahead in the queue (large)")
    # A job that needs nothing the queue waits for is not held back (backfill that cannot delay).
    assert out["cpu-only"].outcome == ADMITTED


def test_unsatisfiable_more_than_the_quota_allows():
    out = admission.plan([cand("huge", workers=8, gpus=4)], ledgers(gpu_quota(24)), NODES)
    assert out["huge"] == admission.Decision(
        UNSATISFIABLE, "Unsatisfiable",
        "needs 32 nvidia.com/gpu but ResourceQuota team-a/gpu allows at most 24; reduce workers "
        "or per-worker resources, or ask for a larger quota")


def test_unsatisfiable_more_than_the_pool_has():
    out = admission.plan([cand("wide", workers=5, gpus=4)], ledgers(), NODES)
    assert out["wide"] == admission.Decision(
        UNSATISFIABLE, "Unsatisfiable",
        "needs 20 nvidia.com/gpu but node pool 'gpu' has 16 in all; use at most 16 GPUs "
        "(workers x gpusPerWorker) or add nodes to the pool")
    # The InfiniBand pool has 4 x 8.
    out = admission.plan([cand("ib", workers=4, gpus=8, infiniband=True)], ledgers(), NODES)
    assert out["ib"].outcome == ADMITTED


def test_an_unsatisfiable_job_reserves_nothing():
    out = admission.plan([cand("huge", workers=8, gpus=4, created="2026-01-01T00:00:00Z"),
                          cand("ok", created="2026-01-01T00:00:01Z")], ledgers(gpu_quota(8)), NODES)
    assert out["huge"].outcome == UNSATISFIABLE and out["ok"].outcome == ADMITTED


def test_every_quota_of_the_namespace_must_fit():
    pods_quota = {"metadata": {"name": "pods"}, "spec": {"hard": {"pods": "10"}},
                  "status": {"used": {"pods": "8"}}}
    out = admission.plan([cand("a")], ledgers(gpu_quota(24), pods_quota), NODES)
    assert out["a"].message == "needs 3 pods; 2 of 10 free in ResourceQuota team-a/pods"


def test_a_scoped_quota_counts_only_matching_pods():
    # Our pods have no activeDeadlineSeconds: a Terminating-scoped quota does not count them.
    scoped = gpu_quota(0)
    scoped["spec"]["scopes"] = ["Terminating"]
    assert admission.plan([cand("a")], ledgers(scoped), NODES)["a"].outcome == ADMITTED
    scoped["spec"]["scopes"] = ["NotTerminating"]
    assert admission.plan([cand("a")], ledgers(scoped), NODES)["a"].outcome == UNSATISFIABLE


def test_namespace_gpu_cap_applies_without_a_gpu_quota():
    cfg = config.from_dict({"limits": {"namespaceGpus": 8}})
    pods = [running_pod("other-worker-0", 4), running_pod("done", 4, phase="Succeeded")]
    out = admission.plan([cand("a")], ledgers(pods=pods, cfg=cfg), NODES)
    assert out["a"].message == ("needs 8 nvidia.com/gpu; 4 of 8 free in the operator's "
                                "limits.namespaceGpus")
    # A ResourceQuota on GPUs replaces the cap.
    out = admission.plan([cand("a")], ledgers(gpu_quota(16), pods=pods, cfg=cfg), NODES)
    assert out["a"].outcome == ADMITTED


def test_namespace_gpu_cap_must_be_a_count():
    with pytest.raises(config.ConfigError, match="limits.namespaceGpus"):
        admission.namespace_gpu_cap(config.from_dict({"limits": {"namespaceGpus": "lots"}}))


def test_gpu_totals_for_metrics():
    cands = [cand("run", admitted=True), cand("wait", workers=4, gpus=4)]
    decisions = admission.plan(cands, ledgers(gpu_quota(16)), NODES)
    assert admission.gpu_totals(cands, decisions) == {"queuedJobs": 1, "queuedGpus": 16,
                                                      "admittedGpus": 8}


def test_kueue_workload_has_a_pod_set_per_role():
    wl = kueue.render_workload(job(workers=3, gpus=4), "team-a-queue")
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == "dtj-a" and wl["metadata"]["namespace"] == "team-a"
    assert wl["spec"]["queueName"] == "team-a-queue"
    sets = {s["name"]: s for s in wl["spec"]["podSets"]}
    assert sets["workers"]["count"] == 3 and sets["launcher"]["count"] == 1
    worker = sets["workers"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    # no class at all (none named, no cluster default): priority 0, no reference (Kueue's own
    # default); tests/unit/test_priority.py has the classes
    assert wl["spec"]["priority"] == 0 and "priorityClassRef" not in wl["spec"]
    assert [s["name"] for s in kueue.render_workload(job(launcher="torchrun"), "q")["spec"]
            ["podSets"]] == ["workers"]
