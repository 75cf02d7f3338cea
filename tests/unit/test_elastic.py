"""spec.elastic (issue 26, the operator's half) as tables: the size choice, the spec's checks,
TRAINOP_ELASTIC_MAX_WORLD on every rank, and decide()'s shrink and grow (snapshots in, status,
actions and Events out; tests/cluster/test_elastic.py drives the real scheduler)."""

from __future__ import annotations

import copy
import datetime as dt

import pytest

from tests.unit.test_jobsync_decide import NOW, T0, launcher, reasons, shared, snap, summary, workers
from tests.unit.test_jobsync_decide import body as plain_body
from tests.unit.test_jobsync_failures import CFG, CREATED, RUNNING, on_node, unschedulable
from trainop import conditions, config, kueue
from trainop.actions import Create, Delete, Patch
from trainop.jobsync import decide
from trainop.jobsync.elastic import pool_capacity, size_for
from trainop.render import dtj as render
from trainop.spec import Elastic, SpecError, parse

CKPT = {"volume": {"claimName": "ck"}}
OUT = {"pvc": {"claimName": "out"}}  # worker 0's shipper reports each new checkpoint


def spot_nodes(n: int, gpus: int = 4) -> list[dict]:
    return [{"metadata": {"name": f"aks-spot-{i}", "labels": {config.POOL_LABEL: "spot"}},
             "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}} for i in range(n)]


def body(status=None, **elastic) -> dict:
    elastic.setdefault("minWorkers", 2)
    return plain_body(status, workers=4, nodePool={"name": "spot"}, checkpoint=CKPT, output=OUT,
                      elastic=elastic)


def decide_(s, now=NOW):
    return decide(s, CFG, now)


# ---- the size choice ---------------------------------------------------------------------------

@pytest.mark.parametrize("fits, low, high, size", [
    (4, 2, 4, 4), (9, 2, 4, 4), (3, 2, 4, 2), (2, 2, 4, 2), (1, 2, 4, None), (0, 1, 4, None),
    (1, 1, 1, 1), (7, 1, 8, 4), (5, 3, 6, 3), (5, 4, 6, None), (7, 2, 6, 6),
])
def test_the_largest_size_that_fits_and_no_fewer_than_min_workers(fits, low, high, size):
    assert size_for(fits, Elastic(low, high, 60, True)) == size


# ---- the spec ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, field, words", [
    ({"elastic": {"minWorkers": 2, "maxWorkers": 8}}, "spec.elastic.maxWorkers",
     "differs from spec.workers (4)"),
    ({"elastic": {"minWorkers": 5}}, "spec.elastic.minWorkers", "more than maxWorkers (4): use at most 4"),
    ({"elastic": {"minWorkers": 3}}, "spec.elastic.minWorkers",
     "no size from 3 to 3 divides maxWorkers (4), so the gang could never shrink"),
    ({"elastic": {"minWorkers": 2}, "mpirun": {"runLauncherAsWorker": True}, "output": {"pvc": {"claimName": "o"}}},
     "spec.elastic", "remove spec.mpirun.runLauncherAsWorker"),
    ({"elastic": {"minWorkers": 2, "growAtCheckpoint": False}, "checkpoint": None}, "spec.elastic",
     "set spec.checkpoint"),
    ({"elastic": {"minWorkers": 2}}, "spec.elastic.growAtCheckpoint", "set spec.output, or growAtCheckpoint: false"),
])
def test_bad_elastic_specs_name_the_field_and_the_fix(spec, field, words):
    raw = {"workers": 4, "nodePool": {"name": "spot"}, "checkpoint": CKPT, **spec}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(SpecError) as err:
        parse(plain_body(**raw), CFG)
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_a_bad_elastic_spec_fails_the_job_before_any_child():
    out = decide_(snap(plain_body(workers=4, checkpoint=CKPT, elastic={"minWorkers": 6}),
                       nodes=spot_nodes(4)))
    assert reasons(out.status)["Failed"] == ("True", "InvalidSpec")
    assert out.actions == []


def test_defaults_max_workers_is_spec_workers():
    el = parse(body(), CFG).elastic
    assert el == Elastic(min_workers=2, max_workers=4, shrink_after_seconds=120,
                         grow_at_checkpoint=True)


# ---- the trainer's contract ---------------------------------------------------------------------

def _env(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def test_every_rank_gets_the_largest_world_at_every_size():
    job = parse(plain_body(workers=4, slotsPerWorker=2, checkpoint=CKPT,
                           elastic={"minWorkers": 2, "growAtCheckpoint": False}), CFG)
    small = job.__class__(**{**job.__dict__, "workers": 3})
    for j in (job, small):
        worker = render.render_worker(j, 0, 0)["spec"]["containers"][0]
        launch = render.render_launcher(j, 0)["spec"]["template"]["spec"]["containers"][0]
        assert _env(worker)["TRAINOP_ELASTIC_MAX_WORLD"] == "8"
        assert _env(launch)["TRAINOP_ELASTIC_MAX_WORLD"] == "8"
        # mpirun forwards it to every rank it starts
        command = " ".join(launch.get("command") or []) + " ".join(launch.get("args") or [])
        assert "-x TRAINOP_ELASTIC_MAX_WORLD" in command
    assert render.render_config_map(small)["data"]["hostfile"].count("slots=2") == 3
    plain = parse(plain_body(workers=4), CFG)
    assert "TRAINOP_ELASTIC_MAX_WORLD" not in _env(render.render_worker(plain, 0, 0)["spec"]["containers"][0])


def test_torchrun_ranks_get_it_and_nnodes_follows_the_size():
    job = parse(plain_body(workers=4, launcher="torchrun", checkpoint=CKPT,
                           elastic={"minWorkers": 1, "growAtCheckpoint": False}), CFG)
    small = job.__class__(**{**job.__dict__, "workers": 2})
    worker = render.render_worker(small, 0, 0)["spec"]["containers"][0]
    assert _env(worker)["TRAINOP_ELASTIC_MAX_WORLD"] == "16"  # 4 workers x 4 GPUs
    assert "--nnodes=2" in " ".join(worker.get("command", []) + worker.get("args", []))


# ---- shrink ------------------------------------------------------------------------------------

AGO = (NOW - dt.timedelta(seconds=130)).strftime("%Y-%m-%dT%H:%M:%SZ")  # past shrinkAfterSeconds


def waiting_status(since: str = AGO) -> dict:
    """Attempt 1 after a spot eviction: worker 3 waits for a node since `since`."""
    st = {"phase": "Starting", "startTime": T0, "attempt": 1,
          "restarts": {"failures": 0, "disruptions": 1, "spotEvictions": 1},
          "conditions": conditions.set_condition(copy.deepcopy(CREATED), "WaitingForNodes", True,
                                                 "WaitingForNodes", "m", timestamp=since)}
    return st


def three_placed(since: str = AGO) -> list[dict]:
    pods = workers(4, attempt=1)
    for i in range(3):
        on_node(pods[i], f"aks-spot-{i}")
    pods[3] = unschedulable(workers(4, attempt=1, ready=False)[3])
    pods[3]["status"]["conditions"][0]["lastTransitionTime"] = since
    return pods


def test_a_gang_short_of_nodes_for_shrink_after_seconds_restarts_smaller():
    out = decide_(snap(body(waiting_status()), pods=three_placed(), nodes=spot_nodes(3), **shared()))
    st = out.status
    # 3 placed, but 3 workers of 4 cannot share the global batch: 2 (size_for)
    assert (st["attempt"], st["phase"], st["elastic"]["workers"]) == (2, "Starting", 2)
    assert st["elastic"]["capacity"] == 3
    assert st["restarts"]["resizes"] == 1
    assert (st["restarts"]["failures"], st["restarts"]["disruptions"]) == (0, 1)
    entry = st["restarts"]["history"][-1]
    assert {k: entry[k] for k in ("attempt", "cause", "counted", "fromWorkers", "toWorkers")} == \
        {"attempt": 2, "cause": "CapacityLost", "counted": False, "fromWorkers": 4, "toWorkers": 2}
    assert "the pool placed 3 of 4 workers within shrinkAfterSeconds=120" in entry["message"]
    assert reasons(st)["Restarting"] == ("True", "Resized")
    assert [(t, r) for t, r, _ in out.events if r == "Resized"] == [("Normal", "Resized")]
    assert not [a for a in summary(out.actions) if a.startswith("create Pod")]


def test_before_shrink_after_seconds_it_waits_and_wakes_at_that_moment():
    since = (NOW - dt.timedelta(seconds=50)).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = decide_(snap(body(waiting_status(since)), pods=three_placed(since), nodes=spot_nodes(3),
                       **shared()))
    assert out.status["attempt"] == 1 and out.status["elastic"]["workers"] == 4
    assert out.requeue_after == 70
    assert "shrinking to 2 in 70s" in out.status["elastic"]["message"]
    assert "Resized" not in [r for _, r, _ in out.events]


def test_fewer_placed_than_min_workers_waits_for_nodes_and_says_so():
    pods = three_placed()
    pods[1], pods[2] = (unschedulable(workers(4, attempt=1, ready=False)[i]) for i in (1, 2))
    out = decide_(snap(body(waiting_status()), pods=pods, nodes=spot_nodes(1), **shared()))
    assert out.status["attempt"] == 1
    assert reasons(out.status)["WaitingForNodes"][0] == "True"
    assert "1/4 workers placed, fewer than minWorkers 2" in out.status["elastic"]["message"]


def test_the_shrunk_attempt_replaces_the_old_pods_with_fewer_workers():
    shrunk = decide_(snap(body(waiting_status()), pods=three_placed(), nodes=spot_nodes(3), **shared())).status
    gone = decide_(snap(body(copy.deepcopy(shrunk)), pods=three_placed(), nodes=spot_nodes(3), **shared()))
    assert [a for a in summary(gone.actions) if a.startswith("delete")] == \
        [f"delete Pod j-worker-{i}" for i in range(4)]
    fresh = decide_(snap(body(copy.deepcopy(shrunk)), nodes=spot_nodes(3), **shared()))
    created = [a.obj for a in fresh.actions if type(a).__name__ == "Create" and a.obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in created] == [f"j-worker-{i}" for i in range(2)]
    assert all(p["metadata"]["labels"]["trainop.io/attempt"] == "2" for p in created)
    hostfile = [a.obj for a in fresh.actions
                if a.obj.get("metadata", {}).get("name") == "j-mpi"][0]["data"]["hostfile"]
    assert hostfile.count("slots=") == 2
    assert fresh.status["workers"]["total"] == 2


# ---- grow --------------------------------------------------------------------------------------

def shrunk_running(step: int = 100, **elastic) -> dict:
    st = {**copy.deepcopy(RUNNING), "attempt": 2,
          "restarts": {"failures": 0, "disruptions": 1, "resizes": 1},
          "elastic": {"workers": 2, "capacity": 3, "fits": 3, **elastic},
          "checkpoint": {"step": step, "path": "/checkpoints/j-uid-1/attempt-2/step-100",
                         "url": "pvc://ck/j-uid-1/attempt-2/step-100"}}
    return st


def running_pods(n: int = 2, attempt: int = 2) -> list[dict]:
    return [on_node(p, f"aks-spot-{i}") for i, p in enumerate(workers(n, attempt=attempt))]


def test_capacity_back_grows_at_the_next_checkpoint():
    first = decide_(snap(body(shrunk_running()), pods=running_pods(), launcher=launcher(2),
                         nodes=spot_nodes(4), **shared()))
    st = first.status
    assert (st["attempt"], st["elastic"]["growTo"], st["elastic"]["growAfterStep"]) == (2, 4, 100)
    assert "growing to 4 workers at the next checkpoint" in st["elastic"]["message"]
    assert not [a for a in summary(first.actions) if a.startswith("delete")]
    saved = copy.deepcopy(st)
    saved["checkpoint"]["step"] = 200
    grown = decide_(snap(body(saved), pods=running_pods(), launcher=launcher(2),
                         nodes=spot_nodes(4), **shared()))
    gs = grown.status
    assert (gs["attempt"], gs["elastic"], gs["restarts"]["resizes"]) == (3, {
        "workers": 4, "message": gs["elastic"]["message"]}, 2)
    entry = gs["restarts"]["history"][-1]
    assert (entry["cause"], entry["fromWorkers"], entry["toWorkers"]) == ("CapacityReturned", 2, 4)
    assert "checkpoint step 200 saved" in entry["message"]
    assert ("Normal", "Resized") in [(t, r) for t, r, _ in grown.events]


def test_grow_at_checkpoint_false_grows_at_once():
    out = decide_(snap(body(shrunk_running(), growAtCheckpoint=False), pods=running_pods(),
                       launcher=launcher(2), nodes=spot_nodes(4), **shared()))
    assert (out.status["attempt"], out.status["elastic"]["workers"]) == (3, 4)
    assert "the ranks save on SIGTERM" in out.status["restarts"]["history"][-1]["message"]


def test_no_grow_while_the_pool_holds_no_more_than_at_the_shrink():
    """Capacity is judged against its value when the gang shrank: a pool whose free node went
    to another tenant (the estimate unchanged) does not make the gang flap."""
    out = decide_(snap(body(shrunk_running(capacity=4)), pods=running_pods(), launcher=launcher(2),
                       nodes=spot_nodes(4), **shared()))
    assert out.status["attempt"] == 2 and "growTo" not in out.status["elastic"]
    lost = decide_(snap(body(shrunk_running()), pods=running_pods(), launcher=launcher(2),
                        nodes=spot_nodes(4), lost_nodes={"aks-spot-3": {"name": "aks-spot-3"}},
                        **shared()))
    assert lost.status["attempt"] == 2 and "growTo" not in lost.status["elastic"]


def test_a_grow_waiting_for_its_checkpoint_is_dropped_when_the_room_goes_again():
    waiting = shrunk_running(growTo=4, growAfterStep=100)
    waiting["checkpoint"]["step"] = 200
    out = decide_(snap(body(waiting), pods=running_pods(), launcher=launcher(2),
                       nodes=spot_nodes(3), **shared()))
    assert out.status["attempt"] == 2 and "growTo" not in out.status["elastic"]
    assert "went again" in out.status["elastic"]["message"]


def test_pool_capacity_counts_whole_workers_on_usable_nodes():
    job = parse(body(), CFG)
    nodes = spot_nodes(3) + spot_nodes(1, gpus=8)[:0] + [
        {"metadata": {"name": "big", "labels": {config.POOL_LABEL: "spot"}},
         "status": {"allocatable": {"nvidia.com/gpu": "8"}}},
        {"metadata": {"name": "other", "labels": {config.POOL_LABEL: "gpu"}},
         "status": {"allocatable": {"nvidia.com/gpu": "8"}}}]
    assert pool_capacity(job, nodes, {}, ()) == 5
    assert pool_capacity(job, nodes, {"big": {}}, ("aks-spot-0",)) == 2


def test_a_job_without_elastic_never_resizes():
    """The same shortage without spec.elastic: it waits for nodes, at its size, for ever."""
    out = decide_(snap(plain_body(waiting_status(), workers=4, nodePool={"name": "spot"}),
                       pods=three_placed(), nodes=spot_nodes(3), **shared()))
    assert out.status["attempt"] == 1 and "elastic" not in out.status
    assert reasons(out.status)["WaitingForNodes"][0] == "True"


# ---- Kueue follows the size --------------------------------------------------------------------

SLICES = config.from_dict({**CFG.raw, "kueue": {"workloadSlices": True}})
ADMITTED = (("QuotaReserved", True, "QuotaReserved"), ("Admitted", True, "Admitted"))


def elastic_workload(count: int, *conds, name: str = "dtj-j", replaces: str | None = None,
                     created: str = T0) -> dict:
    job = parse(body(), CFG)
    wl = kueue.render_workload(job.__class__(**{**job.__dict__, "workers": count}), "team",
                               slices=True)
    status: dict = {"conditions": []}
    for type_, value, reason in conds:
        status["conditions"] = conditions.set_condition(status["conditions"], type_, value,
                                                        reason, "m", timestamp=T0)
    if any(c[0] == "Admitted" for c in conds):
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "workers", "flavors": {}}, {"name": "launcher", "flavors": {}}]}
    wl["metadata"].update(name=name, uid=f"uid-{name}", resourceVersion="42", creationTimestamp=created,
                          ownerReferences=[{"controller": True, "uid": "uid-1"}],
                          finalizers=[kueue.FINALIZER])
    if replaces:
        wl["metadata"]["annotations"][kueue.REPLACES_ANNOTATION] = f"ns/{replaces}"
    wl["status"] = status
    return wl


def kueue_body(status=None, **elastic) -> dict:
    b = body(status, **elastic)
    b["spec"]["queue"] = "team"
    return b


def test_pick_tells_the_running_workload_from_a_waiting_slice_and_a_replaced_one():
    old = elastic_workload(3, *ADMITTED)
    new = elastic_workload(4, name="dtj-j-a3", replaces="dtj-j", created="2026-05-01T11:30:00Z")
    assert kueue.pick([new, old]) == (old, new, [])
    admitted = elastic_workload(4, *ADMITTED, name="dtj-j-a3", replaces="dtj-j",
                                created="2026-05-01T11:30:00Z")
    assert kueue.pick([old, admitted]) == (admitted, None, [])  # before Kueue finishes the old
    replaced = elastic_workload(3, *ADMITTED, ("Finished", True, kueue.SLICE_REPLACED))
    assert kueue.pick([replaced, admitted]) == (admitted, None, [replaced])
    ended = elastic_workload(4, *ADMITTED, ("Finished", True, "Succeeded"))
    assert kueue.pick([ended]) == (ended, None, [])  # the finished job still drops its finalizer
    assert kueue.pick([]) == (None, None, [])


def test_an_elastic_workload_is_marked_and_a_slice_names_what_it_replaces():
    job = parse(body(), CFG)
    plain = kueue.render_workload(job, "team")
    assert "annotations" not in plain["metadata"]
    old = elastic_workload(3, *ADMITTED)
    wl = kueue.render_workload(job, "team", slices=True, replaces=old, attempt=3)
    assert wl["metadata"]["name"] == "dtj-j-a3"
    assert wl["metadata"]["annotations"] == {kueue.ELASTIC_ANNOTATION: "true",
                                             kueue.REPLACES_ANNOTATION: "ns/dtj-j"}
    assert kueue.worker_count(wl) == 4


def test_scale_down_is_a_guarded_json_patch_of_one_count():
    patch = kueue.scale_down(elastic_workload(4, *ADMITTED), 3)
    assert patch.patch == [{"op": "test", "path": "/spec/podSets/0/name", "value": "workers"},
                           {"op": "test", "path": "/spec/podSets/0/count", "value": 4},
                           {"op": "replace", "path": "/spec/podSets/0/count", "value": 3}]


def shrunk_on_kueue(**more) -> dict:
    st = shrunk_running(**more)
    st["conditions"] = conditions.set_condition(st["conditions"], "Admitted", True, "KueueAdmitted",
                                                "m", timestamp=T0)
    return st


def kueue_snap(st, wl, pods, cfg_slices=True, **kw):
    return snap(kueue_body(st), pods=pods, launcher=launcher(2), nodes=spot_nodes(kw.pop("nodes", 3)),
                kueue=True, workload=wl, **shared(), **kw)


def test_with_slices_a_shrunk_gangs_workload_count_goes_down_in_place_once_its_pods_are_gone():
    wl = elastic_workload(4, *ADMITTED)
    out = decide(kueue_snap(shrunk_on_kueue(), wl, running_pods()), SLICES, NOW)
    patches = [a for a in out.actions if isinstance(a, Patch)]
    assert [p.patch[-1] for p in patches] == [{"op": "replace", "path": "/spec/podSets/0/count", "value": 2}]
    assert not [a for a in summary(out.actions) if a.startswith("delete")]  # never replaced
    # a fourth worker of the old attempt still terminating holds its GPUs: not yet
    old = workers(4, attempt=1, deleting=True)[3]
    held = decide(kueue_snap(shrunk_on_kueue(), wl, running_pods() + [old]), SLICES, NOW)
    assert not [a for a in held.actions if isinstance(a, Patch)]
    # without slices, the Workload of another count is replaced once no pod is left
    fresh = copy.deepcopy(shrunk_on_kueue())
    gone = decide(snap(kueue_body(fresh), nodes=spot_nodes(3), kueue=True, workload=wl, **shared()), CFG, NOW)
    assert "delete Workload dtj-j" in summary(gone.actions)
    assert reasons(gone.status)["Admitted"] == ("False", "WorkloadMismatch")


def test_with_slices_a_grow_waits_for_kueue_to_admit_a_bigger_slice():
    wl = elastic_workload(3, *ADMITTED)
    first = decide(kueue_snap(shrunk_on_kueue(), wl, running_pods(), nodes=4), SLICES, NOW)
    made = [a.obj for a in first.actions if isinstance(a, Create) and a.obj["kind"] == "Workload"]
    assert [(w["kind"], w["metadata"]["name"], kueue.worker_count(w)) for w in made] == \
        [("Workload", "dtj-j-a3", 4)]
    assert made[0]["metadata"]["annotations"][kueue.REPLACES_ANNOTATION] == "ns/dtj-j"
    assert first.status["attempt"] == 2 and first.status["elastic"]["growTo"] == 4
    assert "waiting for Kueue to admit Workload slice dtj-j-a3 for 4 workers" in first.status["elastic"]["message"]
    pending = elastic_workload(4, name="dtj-j-a3", replaces="dtj-j", created="2026-05-01T11:30:00Z")
    still = decide(kueue_snap(copy.deepcopy(first.status), wl, running_pods(), nodes=4,
                              workload_slice=pending), SLICES, NOW)
    assert not [a for a in still.actions if isinstance(a, Delete)
                or isinstance(a, Create) and a.obj["kind"] == "Workload"]
    assert still.status["attempt"] == 2
    # admitted (Kueue finished the old one): the gang grows at the next checkpoint
    admitted = elastic_workload(4, *ADMITTED, name="dtj-j-a3", replaces="dtj-j")
    replaced = elastic_workload(3, *ADMITTED, ("Finished", True, kueue.SLICE_REPLACED))
    saved = copy.deepcopy(still.status)
    saved["checkpoint"]["step"] = 200
    grown = decide(kueue_snap(saved, admitted, running_pods(), nodes=4, replaced_workloads=[replaced]),
                   SLICES, NOW)
    assert (grown.status["attempt"], grown.status["elastic"]["workers"]) == (3, 4)
    assert "delete Workload dtj-j" in summary(grown.actions)  # the replaced slice goes
    assert not [a for a in grown.actions if isinstance(a, Patch)]


def test_a_slice_no_grow_waits_for_goes():
    wl = elastic_workload(3, *ADMITTED)
    pending = elastic_workload(4, name="dtj-j-a3", replaces="dtj-j")
    out = decide(kueue_snap(shrunk_on_kueue(), wl, running_pods(), nodes=3, workload_slice=pending),
                 SLICES, NOW)
    assert "delete Workload dtj-j-a3" in summary(out.actions)


def test_without_slices_a_grow_restarts_and_the_new_size_queues_for_admission():
    wl = elastic_workload(3, *ADMITTED)
    out = decide(kueue_snap(shrunk_on_kueue(), wl, running_pods(), nodes=4, workload_slice=None),
                 config.from_dict({**CFG.raw}), NOW)
    assert out.status["elastic"].get("growTo") == 4 and out.status["attempt"] == 2
    saved = copy.deepcopy(out.status)
    saved["checkpoint"]["step"] = 200
    grown = decide(kueue_snap(saved, wl, running_pods(), nodes=4), CFG, NOW)
    assert grown.status["attempt"] == 3
    assert not [a for a in grown.actions if isinstance(a, Create) and a.obj["kind"] == "Workload"]


def test_the_first_workload_of_an_elastic_job_is_marked_only_with_slices():
    def made(cfg):
        out = decide(snap(kueue_body(), nodes=spot_nodes(4), kueue=True, workload=None), cfg, NOW)
        return next(a.obj for a in out.actions if isinstance(a, Create) and a.obj["kind"] == "Workload")
    assert made(SLICES)["metadata"]["annotations"] == {kueue.ELASTIC_ANNOTATION: "true"}
    assert "annotations" not in made(CFG)["metadata"]


def test_on_the_fallback_pool_the_grow_counts_that_pools_nodes():
    """Shrunk on the spot pool (5 workers' room counted there, taken by others), then moved to
    the on-demand pool by nodePool.fallback: its 4 nodes are room for 4, whatever the spot pool
    held (compared with the spot pool's 5, the gang would never grow)."""
    st = shrunk_running(pool="spot", capacity=5)
    st["restarts"]["spotEvictions"] = 1
    b = body(st)
    b["spec"]["nodePool"] = {"name": "spot", "fallback": {"name": "ondemand", "afterSpotEvictions": 1}}
    ondemand = [{"metadata": {"name": f"od-{i}", "labels": {config.POOL_LABEL: "ondemand"}},
                 "status": {"allocatable": {"nvidia.com/gpu": "4"}}} for i in range(4)]
    pods = [on_node(p, f"od-{i}") for i, p in enumerate(workers(3, attempt=2))]
    out = decide_(snap(b, pods=pods, launcher=launcher(2), nodes=ondemand + spot_nodes(3), **shared()))
    assert out.status["elastic"]["pool"] == "ondemand" and out.status["elastic"]["growTo"] == 4
