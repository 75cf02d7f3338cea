"""priority.py and where a job's priority goes: the class a namespace user may name, the cap,
the native queue's order (gate), the pods' priorityClassName, Kueue's Workload, and the job
that names a class nobody created (no cluster; tests/cluster/test_quota.py and test_kueue.py
prove the same against the real API server, scheduler and Kueue)."""

from __future__ import annotations

import copy
import logging

import pytest

from tests.unit.test_jobsync_decide import NOW, RUNNING, body, launcher, reasons, snap, summary, workers
from trainop import admission, conditions, config, gate, jobsync, kueue, priority
from trainop.actions import Create
from trainop.devcluster.pools import default_pools
from trainop.memo import Memos
from trainop.priority import Classes
from trainop.render import dtj as render
from trainop.spec import SpecError, parse

CFG = config.from_dict(None)  # limits.maxPriority 1e9
CAPPED = config.from_dict({"limits": {"maxPriority": 1000}})
UNCAPPED = config.from_dict({"limits": {"maxPriority": None}})
NODES = [n for pool in default_pools() for n in pool.nodes()]


def pc(name: str, value: int, default: bool = False) -> dict:
    return {"metadata": {"name": name}, "value": value, "globalDefault": default}


# What every cluster has, plus what an admin made.
SYSTEM = [pc("system-cluster-critical", 2000000000), pc("system-node-critical", 2000001000)]
CLASSES = Classes.of(SYSTEM + [pc("low", 10), pc("high", 500), pc("urgent", 5000),
                               pc("shared", 100)],
                     [pc("batch", 50), pc("shared", 7000), pc("vip", 900)])
WITH_DEFAULTS = Classes.of([pc("normal", 100, default=True), pc("low", 10, default=True)])

POD_REF = {"group": "scheduling.k8s.io", "kind": "PriorityClass"}
WPC_REF = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass"}

RESOLVED = [
    # (id, name, classes, cfg, kueue, value, Workload priorityClassRef, pods' priorityClassName)
    ("unset, no default class: 0 and no class", None, CLASSES, CFG, False, 0, None, None),
    ("unset: the globalDefault PriorityClass (the lowest if several)", None, WITH_DEFAULTS, CFG,
     False, 10, {**POD_REF, "name": "low"}, "low"),
    ("unset under Kueue: the same default, as Kueue's jobframework picks it", None,
     WITH_DEFAULTS, CFG, True, 10, {**POD_REF, "name": "low"}, "low"),
    ("a PriorityClass, natively", "high", CLASSES, CFG, False, 500, {**POD_REF, "name": "high"},
     "high"),
    ("a PriorityClass under Kueue", "high", CLASSES, CFG, True, 500,
     {**POD_REF, "name": "high"}, "high"),
    ("a WorkloadPriorityClass under Kueue: the pods keep the default", "batch", CLASSES, CFG,
     True, 50, {**WPC_REF, "name": "batch"}, None),
    ("both kinds of that name under Kueue: the WorkloadPriorityClass, as Kueue looks first",
     "shared", CLASSES, UNCAPPED, True, 7000, {**WPC_REF, "name": "shared"}, None),
    ("both kinds natively: only PriorityClasses count", "shared", CLASSES, CFG, False, 100,
     {**POD_REF, "name": "shared"}, "shared"),
    ("at the cap exactly", "urgent", CLASSES, config.from_dict({"limits": {"maxPriority": 5000}}),
     False, 5000, {**POD_REF, "name": "urgent"}, "urgent"),
    ("no cap: even a system class", "system-node-critical", CLASSES, UNCAPPED, False,
     2000001000, {**POD_REF, "name": "system-node-critical"}, "system-node-critical"),
]


@pytest.mark.parametrize("case", RESOLVED, ids=[c[0] for c in RESOLVED])
def test_resolve(case):
    _, name, classes, cfg, on_kueue, value, ref, pod_class = case
    prio = priority.resolve(name, classes, cfg, on_kueue)
    assert (prio.value, prio.ref, prio.pod_class) == (value, ref, pod_class)


REFUSED = [
    # (id, name, cfg, kueue, message)
    ("a class nobody created: the ones that exist are named", "gold", CFG, False,
     "spec.priorityClassName: no PriorityClass 'gold' exists; use one of low (10), "
     "shared (100), high (500), urgent (5000), or leave it unset for the cluster's default"),
    ("under Kueue both kinds are suggested", "gold", CFG, True,
     "spec.priorityClassName: no WorkloadPriorityClass or PriorityClass 'gold' exists; use one "
     "of low (10), batch (50), shared (100), high (500), vip (900), urgent (5000), "
     "shared (7000), or leave it unset for the cluster's default"),
    ("a WorkloadPriorityClass for a job Kueue does not admit", "vip", CFG, False,
     "spec.priorityClassName: 'vip' is a Kueue WorkloadPriorityClass, which orders only jobs "
     "that Kueue admits: set spec.queue to a LocalQueue, or use one of low (10), shared (100), "
     "high (500), urgent (5000), or leave it unset for the cluster's default"),
    ("above the admin's cap: the cap and what is allowed are named", "urgent", CAPPED, False,
     "spec.priorityClassName: PriorityClass 'urgent' (value 5000) is above "
     "limits.maxPriority=1000, the highest priority the cluster admin allows jobs; use one of "
     "low (10), shared (100), high (500), or leave it unset for the cluster's default"),
    ("a WorkloadPriorityClass above the cap", "shared", CAPPED, True,
     "spec.priorityClassName: WorkloadPriorityClass 'shared' (value 7000) is above "
     "limits.maxPriority=1000, the highest priority the cluster admin allows jobs; use one of "
     "low (10), batch (50), shared (100), high (500), vip (900), or leave it unset for the "
     "cluster's default"),
    ("the default cap keeps jobs off the system classes", "system-cluster-critical", CFG, False,
     "spec.priorityClassName: PriorityClass 'system-cluster-critical' (value 2000000000) is "
     "above limits.maxPriority=1000000000, the highest priority the cluster admin allows jobs; "
     "use one of low (10), shared (100), high (500), urgent (5000), or leave it unset for the "
     "cluster's default"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused(case):
    _, name, cfg, on_kueue, message = case
    with pytest.raises(SpecError) as err:
        priority.resolve(name, CLASSES, cfg, on_kueue)
    assert err.value.field == "spec.priorityClassName" and str(err.value) == message


def test_nothing_to_suggest():
    with pytest.raises(SpecError, match="no class a job may use exists: leave it unset, or ask "
                                        "the cluster admin to create a PriorityClass"):
        priority.resolve("gold", Classes.of(SYSTEM), CFG, False)


def test_max_priority_must_be_an_integer():
    with pytest.raises(config.ConfigError, match="limits.maxPriority: must be an integer"):
        config.from_dict({"limits": {"maxPriority": "high"}})
    assert config.from_dict(None).max_priority == 1_000_000_000


def job_body(name="j", created="2026-01-01T00:00:00Z", status=None, **spec) -> dict:
    return {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
            "metadata": {"name": name, "namespace": "q", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created},
            "spec": {"workers": 2, "gpusPerWorker": 4, **spec}, "status": status or {}}


# ---- the pods and the Workload carry it ------------------------------------------------------

def test_every_pod_of_the_gang_carries_the_priority_class():
    job, _ = priority.for_job(parse(job_body(priorityClassName="high"), CFG), CLASSES, CFG, False)
    assert render.render_worker(job, 0, 0)["spec"]["priorityClassName"] == "high"
    assert render.render_launcher(job, 0)["spec"]["template"]["spec"]["priorityClassName"] == \
        "high"
    unset, _ = priority.for_job(parse(job_body(), CFG), CLASSES, CFG, False)
    assert "priorityClassName" not in render.render_worker(unset, 0, 0)["spec"]


def test_bind_returns_one_object_per_job_and_class_with_the_controllers_memo():
    """admission.gang_pods is remembered by the Job's identity: judging a queue again reuses
    it, as long as bind hands out the same object (the controller's memo, memo.py)."""
    job = parse(job_body(priorityClassName="high"), CFG)
    memo = Memos()
    first, _ = priority.for_job(job, CLASSES, CFG, False, memo=memo)
    again, _ = priority.for_job(job, CLASSES, CFG, False, memo=memo)
    assert first is again and first.pod_priority_class == "high"
    assert admission.gang_pods(first, memo) is admission.gang_pods(again, memo)
    # without a memo nothing is remembered (pure callers, tests): equal, not the same
    alone, _ = priority.for_job(job, CLASSES, CFG, False)
    assert alone == first and alone is not first


@pytest.mark.parametrize("name, ref, pod_class", [
    ("high", {**POD_REF, "name": "high"}, "high"),
    ("batch", {**WPC_REF, "name": "batch"}, None),
])
def test_kueue_workload_carries_the_class_reference_and_its_value(name, ref, pod_class):
    job, prio = priority.for_job(parse(job_body(priorityClassName=name, queue="team"), CFG),
                                 CLASSES, CFG, kueue=True)
    wl = kueue.render_workload(job, "team", prio)
    assert wl["spec"]["priorityClassRef"] == ref
    assert wl["spec"]["priority"] == CLASSES.pod.get(name, CLASSES.workload.get(name)).value
    for pod_set in wl["spec"]["podSets"]:
        assert pod_set["template"]["spec"].get("priorityClassName") == pod_class


# ---- the native queue's order -------------------------------------------------------------

G = gate.Gate()


@pytest.fixture
def fresh_gate():
    global G
    G = gate.Gate()


def view(jobs, classes=CLASSES):
    return lambda: gate.NamespaceView(pods=[], quotas=[], jobs=jobs, nodes=NODES, classes=classes)


NS_CAP = config.from_dict({"limits": {"namespaceGpus": 8}})


def queued() -> dict:
    """Both jobs already wait at the gate (as behind a job that just ended)."""
    return {"conditions": conditions.set_condition([], "Admitted", False, "QuotaExceeded", "m")}


def test_the_queue_takes_the_higher_class_first_whatever_the_arrival(fresh_gate):
    early = job_body("early", "2026-01-01T00:00:00Z", queued(), priorityClassName="low")
    late = job_body("late", "2026-01-01T00:01:00Z", queued(), priorityClassName="high")
    jobs = [early, late]
    assert not G.decide(parse(early, NS_CAP), early, NS_CAP, view(jobs)()).admitted
    assert G.decide(parse(late, NS_CAP), late, NS_CAP, view(jobs)()).admitted


def test_without_classes_the_queue_is_first_come(fresh_gate):
    early = job_body("early", "2026-01-01T00:00:00Z", queued(), priorityClassName="low")
    late = job_body("late", "2026-01-01T00:01:00Z", queued(), priorityClassName="high")
    jobs = [early, late]
    flat = Classes.of([pc("low", 1), pc("high", 1)])
    assert G.decide(parse(early, NS_CAP), early, NS_CAP, view(jobs, flat)()).admitted
    assert not G.decide(parse(late, NS_CAP), late, NS_CAP, view(jobs, flat)()).admitted


def test_a_job_naming_no_class_is_ordered_by_the_cluster_default(fresh_gate):
    early = job_body("early", "2026-01-01T00:00:00Z", queued())  # the default: 100
    late = job_body("late", "2026-01-01T00:01:00Z", queued(), priorityClassName="low")  # 10
    jobs = [early, late]
    classes = Classes.of([pc("normal", 100, default=True), pc("low", 10)])
    assert G.decide(parse(late, NS_CAP), late, NS_CAP, view(jobs, classes)()).reason == \
        "QuotaExceeded"
    assert G.decide(parse(early, NS_CAP), early, NS_CAP, view(jobs, classes)()).admitted


def test_an_admitted_job_whose_class_was_deleted_still_holds_its_room(fresh_gate):
    held = job_body("held", "2026-01-01T00:00:00Z", priorityClassName="gone", status={
        "conditions": conditions.set_condition([], "Admitted", True, "QuotaReserved", "m")})
    new = job_body("new", "2026-01-01T00:01:00Z")
    decision = G.decide(parse(new, NS_CAP), new, NS_CAP, view([held, new])())
    assert not decision.admitted and "0 of 8 free" in decision.message


# ---- jobsync: a class that does not exist fails the job before anything is made -------------

def test_an_unknown_class_fails_the_job_and_creates_nothing():
    out = jobsync.decide(snap(body(priorityClassName="gold"), classes=CLASSES), CFG, NOW)
    assert out.actions == [] and out.status["phase"] == "Failed"
    assert reasons(out.status)["Failed"] == ("True", "InvalidSpec")
    failed = next(c for c in out.status["conditions"] if c["type"] == "Failed")
    assert failed["message"].startswith("spec.priorityClassName: no PriorityClass 'gold' exists")
    assert ("Warning", "InvalidSpec", failed["message"]) in out.events


def test_a_class_above_the_cap_fails_the_job_and_creates_nothing():
    out = jobsync.decide(snap(body(priorityClassName="urgent"), classes=CLASSES), CAPPED, NOW)
    assert out.actions == [] and reasons(out.status)["Failed"] == ("True", "InvalidSpec")
    assert "limits.maxPriority=1000" in out.status["conditions"][0]["message"]


def test_a_known_class_reaches_the_gate_and_the_pods():
    s = snap(body(priorityClassName="high"), admit=None, classes=CLASSES)
    asked = jobsync.decide(s, CFG, NOW)
    # the controller asks its gate with the job bound to its class (the quota scope it hits)
    assert asked.asks.pod_priority_class == "high" and asked.actions == []
    s.admission = jobsync.Decision("Admitted", "QuotaReserved", "fits")
    out = jobsync.decide(s, CFG, NOW)
    pods = [a.obj for a in out.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert len(pods) == 2 and all(p["spec"]["priorityClassName"] == "high" for p in pods)


def test_a_running_job_whose_class_was_deleted_keeps_running():
    """Kubernetes leaves running pods of a deleted PriorityClass alone; so does the operator:
    a gang restart's new pods get the cluster's default instead of being refused."""
    s = snap(body(copy.deepcopy(RUNNING), priorityClassName="gone"), pods=workers(),
             launcher=launcher(), classes=CLASSES)
    out = jobsync.decide(s, CFG, NOW)
    assert out.status["phase"] == "Running" and "Failed" not in reasons(out.status)
    # (children always kept in shape; free when unchanged)
    assert summary(out.actions) == ["apply NetworkPolicy j", "apply Service j", "apply ConfigMap j-mpi",
                                    "create ssh Secret"]


# ---- without Kueue: the WorkloadPriorityClass watch is quietly unresolved ------------------

def _warning(text: str) -> logging.LogRecord:
    return logging.LogRecord("kopf._core.reactor.observation", logging.WARNING, __file__, 1,
                             text, None, None)


def test_only_optional_kinds_may_be_unresolved_quietly():
    """Kueue's kinds and the gang schedulers' PodGroups are watched where served."""
    from trainop.handlers import indexes
    head = "Unresolved resources cannot be served (try creating their CRDs): "
    optional = (f"{head}Selector(group='kueue.x-k8s.io', version='v1beta2', plural='workloads'),"
                f" Selector(group='kueue.x-k8s.io', version='v1beta2', "
                f"plural='workloadpriorityclasses'),"
                f" Selector(group='scheduling.x-k8s.io', version='v1alpha1', plural='podgroups'),"
                f" Selector(group='scheduling.volcano.sh', version='v1beta1', plural='podgroups')")
    assert not indexes._optional_apis(_warning(optional))
    also_ours = optional + ", Selector(group='trainop.io', version='v1alpha1', plural='x')"
    assert indexes._optional_apis(_warning(also_ours))


def test_a_quota_scoped_to_a_class_counts_the_jobs_that_name_it():
    """Kubernetes' own way to keep a class out of a namespace (a ResourceQuota whose
    scopeSelector names the class, hard pods: 0) works because the pods carry the class."""
    from trainop import admission
    quota = {"metadata": {"name": "no-high"},
             "spec": {"hard": {"pods": "0"}, "scopeSelector": {"matchExpressions": [
                 {"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]}},
             "status": {"used": {}}}
    ledgers = admission.ledgers("q", [quota], [], CFG, {"nvidia.com/gpu"})

    def why(name):
        job, _ = priority.for_job(parse(job_body(priorityClassName=name), CFG), CLASSES, CFG,
                                  False)
        return admission.unsatisfiable(admission.candidate(job, {}, []), ledgers, NODES)
    assert why("high") == ("needs 3 pods but ResourceQuota q/no-high allows at most 0; reduce "
                           "workers or per-worker resources, or ask for a larger quota")
    assert why("low") is None


def test_a_class_missing_from_the_cache_is_read_once_before_the_job_could_fail(monkeypatch):
    """An admin creates the class and a user the job a moment later: the job's event can come
    before the class's. The controller asks the API server before the pure decision."""
    from trainop import apply, controller
    asked = []

    def get(api_version, kind, name, namespace=None):
        asked.append((kind, name))
        return pc(name, 300) if kind == "PriorityClass" else None
    monkeypatch.setattr(apply.kube, "get", get)
    s = snap(body(priorityClassName="fresh"))
    controller._confirm_class(s)
    assert asked == [("PriorityClass", "fresh")] and s.classes.pod["fresh"].value == 300
    asked.clear()
    controller._confirm_class(snap(body(priorityClassName="fresh"), kueue=True))
    assert asked == [("PriorityClass", "fresh"), ("WorkloadPriorityClass", "fresh")]
    asked.clear()
    for known in (snap(body(priorityClassName="high"), classes=CLASSES),
                  snap(body(copy.deepcopy(RUNNING), priorityClassName="gone"))):
        controller._confirm_class(known)  # in the cache, or admitted already: no API call
    assert asked == []
