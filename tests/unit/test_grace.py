"""terminationGracePeriodSeconds sized from the job's slowest checkpoint save (issue 24 item 4),
decided without a cluster: the trainer's COMPLETE says how long the save took, the log
shipper reports it, jobsync keeps the slowest in status.checkpoint.saveSeconds, and the pods
made after it (render/dtj.py grace_seconds) and the operator's own deletions of the running
ones (delete_grace_seconds) get room for it."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from tests.unit.test_jobsync_decide import (
    BLOB,
    CFG,
    NOW,
    RESTARTING,
    RUNNING,
    body,
    launcher,
    shared,
    snap,
    workers,
)
from tests.unit.test_resume import EMPTY, FOLDER, ROOT, VOLUME, job, report
from trainop import config, logship, resume
from trainop.actions import Delete
from trainop.jobsync import decide
from trainop.render import dtj
from trainop_trainer import checkpoint

PATH0 = f"{FOLDER}/0/output/checkpoints/attempt-0/step-500"


def measured(seconds: float | None, **spec_):
    return dataclasses.replace(job(**spec_), save_seconds=seconds)


# ---- the rule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("save,expected", [
    (None, 30),   # nothing measured: Kubernetes' default
    (1.0, 30),    # a fast save: the floor
    (10.0, 30),   # 10 x 1.5 + 15 = 30
    (31.0, 62),   # a save slower than 30 s: ceil(31 x 1.5 + 15)
    (45.2, 83),   # ceil(82.8)
    (400.0, 600),  # the admin's cap (limits.maxCheckpointGraceSeconds, default 600)
])
def test_the_ranks_share_is_the_save_with_a_margin_between_the_floor_and_the_cap(save, expected):
    assert dtj.save_grace(measured(save, checkpoint=VOLUME)) == expected


def test_the_cap_is_the_admins():
    cfg = config.from_dict({"limits": {"maxCheckpointGraceSeconds": 120}})
    from trainop import spec
    j = dataclasses.replace(spec.parse(body(checkpoint=VOLUME), cfg), save_seconds=400.0)
    assert dtj.save_grace(j) == 120
    for bad in (29, 86401, "600", True, None):
        with pytest.raises(config.ConfigError, match="limits.maxCheckpointGraceSeconds"):
            config.from_dict({"limits": {"maxCheckpointGraceSeconds": bad}})


def grace_of(pod: dict) -> int | None:
    return pod["spec"].get("terminationGracePeriodSeconds")


def test_every_pod_of_the_gang_gets_it_the_launcher_too():
    """mpirun must outlive the ranks' save: the launcher's pod gets what the workers get."""
    j = measured(31.0, checkpoint=VOLUME)
    assert [grace_of(dtj.render_worker(j, i, 1)) for i in range(2)] == [62, 62]
    assert grace_of(dtj.render_launcher(j, 1)["spec"]["template"]) == 62
    unmeasured = measured(None, checkpoint=VOLUME)
    assert grace_of(dtj.render_worker(unmeasured, 1, 1)) is None  # Kubernetes' 30 s
    torchrun = measured(31.0, checkpoint=VOLUME, launcher="torchrun")
    assert grace_of(dtj.render_worker(torchrun, 1, 1)) == 62


def test_with_a_log_shipper_its_drain_comes_on_top_of_the_ranks_share():
    """The kubelet stops the native sidecar only once the training container ended, within the
    same grace period: drainSeconds (300) + the ranks' share. Workers that do not ship get the
    share alone."""
    j = measured(31.0, output=BLOB)
    assert grace_of(dtj.render_worker(j, 0, 1)) == 300 + 62
    assert grace_of(dtj.render_worker(j, 1, 1)) == 62
    assert grace_of(dtj.render_launcher(j, 1)["spec"]["template"]) == 300 + 62
    assert grace_of(dtj.render_worker(measured(None, output=BLOB), 0, 1)) == 300 + 30  # as before


@pytest.mark.parametrize("save", [None, 1.0, 400.0])
def test_the_users_value_wins_over_the_measure_and_the_cap(save):
    """spec.terminationGracePeriodSeconds is what the user chose, measured or not, above the
    admin's cap too (the CRD bounds it at 86400); with a shipper the drain + 30 s stays the least."""
    assert grace_of(dtj.render_worker(measured(save, checkpoint=VOLUME, terminationGracePeriodSeconds=900), 1, 1)) == 900
    assert grace_of(dtj.render_worker(measured(save, checkpoint=VOLUME, terminationGracePeriodSeconds=5), 1, 1)) == 5
    shipped = measured(save, output=BLOB, terminationGracePeriodSeconds=5)
    assert grace_of(dtj.render_worker(shipped, 0, 1)) == 330
    assert dtj.delete_grace_seconds(shipped) is None


def test_the_operators_own_deletions_use_the_longest_grace_a_pod_would_get_now():
    assert dtj.delete_grace_seconds(measured(None, checkpoint=VOLUME)) is None  # each pod's own
    assert dtj.delete_grace_seconds(measured(31.0, checkpoint=VOLUME)) == 62
    assert dtj.delete_grace_seconds(measured(31.0, output=BLOB)) == 362


# ---- the report ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value,kept", [
    (31.24, 31.2), (0, 0.0), (86400, 86400.0),
    (-1, None), (86401, None), ("31", None), (True, None), (None, None), (float("nan"), None),
])
def test_a_reports_save_seconds_is_taken_only_when_it_is_a_sane_number(value, kept):
    cm = report(EMPTY, step=500, path=PATH0, saveSeconds=value)
    found, refused = resume.accept(job(output=BLOB), cm)
    assert refused is None and found["step"] == 500  # the checkpoint itself is taken either way
    assert found.get("saveSeconds") == kept


def test_status_keeps_the_slowest_save_reported():
    assert resume.slowest_save({"step": 9, "saveSeconds": 2.0}, {"step": 5, "saveSeconds": 40.0}) == \
        {"step": 9, "saveSeconds": 40.0}
    assert resume.slowest_save({"step": 9, "saveSeconds": 50.0}, {"step": 5, "saveSeconds": 40.0}) == \
        {"step": 9, "saveSeconds": 50.0}
    assert resume.slowest_save({"step": 9}, {"step": 5, "saveSeconds": 40.0}) == {"step": 9, "saveSeconds": 40.0}
    assert resume.slowest_save({"step": 9}, None) == {"step": 9}


def test_the_trainers_marker_says_how_long_the_save_took_and_the_shipper_reports_it(tmp_path):
    folder = checkpoint.write_atomic(tmp_path / "attempt-0", 7, {"state.bin": b"x"}, {"epoch": 1, "worldSize": 1},
                                     save=lambda obj, path: path.write_bytes(obj))
    marker = json.loads((folder / "COMPLETE").read_text())
    assert isinstance(marker["saveSeconds"], float) and 0 <= marker["saveSeconds"] < 5
    patches: list[dict] = []
    logship.CheckpointReporter(tmp_path / "attempt-0", patches.append).tick()
    sent = json.loads(patches[0]["data"]["checkpoint"])
    assert sent == {"step": 7, "path": str(folder), "time": marker["time"], "saveSeconds": marker["saveSeconds"]}


# ---- jobsync: report -> status -> the next pods, and the deletions of the running ones ----------
def test_a_slow_save_reported_sizes_the_next_attempts_pods_and_the_stop_of_the_running_ones():
    cm = report(EMPTY, step=500, path=f"{ROOT}/attempt-0/step-500", saveSeconds=45.2)
    running = snap(body(copy.deepcopy(RUNNING), checkpoint=VOLUME), pods=workers(), launcher=launcher(),
                   **shared(), progress=cm)
    out = decide(running, CFG, NOW)
    assert out.status["checkpoint"]["saveSeconds"] == 45.2
    # a faster save later keeps the slowest
    faster = report(EMPTY, step=1000, path=f"{ROOT}/attempt-0/step-1000", saveSeconds=3.0)
    again = decide(snap(body(out.status, checkpoint=VOLUME), pods=workers(), launcher=launcher(),
                        **shared(), progress=faster), CFG, NOW)
    assert again.status["checkpoint"]["step"] == 1000 and again.status["checkpoint"]["saveSeconds"] == 45.2

    # suspended: the running pods were made with 30 s; the operator's deletion gives them 83 s,
    # the launcher Job after its pods (the garbage collector's deletion would use the pod's own)
    stop = decide(snap(body(again.status, checkpoint=VOLUME, runPolicy={"suspend": True}), pods=workers(),
                       launcher=launcher(), **shared(), progress=faster), CFG, NOW)
    deletes = [a for a in stop.actions if isinstance(a, Delete)]
    assert [(a.ref.kind, a.grace_seconds) for a in deletes] == [("Pod", 83), ("Pod", 83), ("Job", None)]

    # the next attempt's pods get it in their spec
    restarting = copy.deepcopy(RESTARTING) | {"checkpoint": again.status["checkpoint"]}
    pods = [a.obj for a in decide(snap(body(restarting, checkpoint=VOLUME), **shared(), progress=faster),
                                  CFG, NOW).actions if a.obj.get("kind") == "Pod"]
    assert [grace_of(p) for p in pods] == [83, 83]


@pytest.mark.parametrize("spec_,known", [
    ({"checkpoint": VOLUME}, {"step": 5}),  # nothing measured
    ({"checkpoint": VOLUME, "terminationGracePeriodSeconds": 50}, {"step": 5, "saveSeconds": 45.2}),  # the user's
])
def test_without_a_measure_or_with_the_users_value_the_pods_own_grace_is_used(spec_, known):
    status = copy.deepcopy(RUNNING) | {"checkpoint": known}
    stop = decide(snap(body(status, runPolicy={"suspend": True}, **spec_), pods=workers(),
                       launcher=launcher(), **shared()), CFG, NOW)
    assert {a.grace_seconds for a in stop.actions if isinstance(a, Delete)} == {None}
