"""Resume on restart, decided without a cluster: which checkpoint the next attempt gets
(trainop.resume), what the pods are told (render/dtj.py, render/logship.py), and jobsync
carrying the shipper's report into status.checkpoint and into the next attempt's pods."""

from __future__ import annotations

import copy
import json

import pytest

from tests.unit.test_jobsync_decide import (
    BLOB,
    CFG,
    NOW,
    RESTARTING,
    RUNNING,
    UID,
    body,
    launcher,
    progress,
    shared,
    snap,
    workers,
)
from trainop import config, resume, spec
from trainop.jobsync import attempt, decide
from trainop.render import dtj


def job(**spec_):
    b = body(**spec_)
    return spec.parse(b, config.from_dict(None))


def report(cm_progress: dict, **value) -> dict:
    cm = copy.deepcopy(cm_progress)
    cm["data"]["checkpoint"] = json.dumps(value)
    return cm


EMPTY = progress("{}")
VOLUME = {"volume": {"claimName": "ckpts"}}
ROOT = f"/checkpoints/j-{UID[:8]}"
FOLDER = f"ns/j-{UID[:8]}"  # the job's blob folder: BLOB has no prefix; namespace, name-uid8
BLOB_PATH = f"{FOLDER}/1/output/checkpoints/attempt-1/step-500"


# ---- when checkpointing is on -----------------------------------------------------------------
@pytest.mark.parametrize("spec_,expected", [
    ({}, None),  # nowhere to keep them: off
    ({"output": BLOB}, ("/output/checkpoints", 500, False)),
    ({"output": {"pvc": {"claimName": "out"}}}, (f"/output/checkpoints/j-{UID[:8]}", 500, True)),
    ({"checkpoint": {**VOLUME, "everySteps": 50}}, (ROOT, 50, True)),
    ({"output": BLOB, "checkpoint": {"enabled": False}}, None),
    # TensorFlow and Keras (Horovod, launcher mpi) resume too: on by default alike
    ({"output": BLOB, "framework": "tensorflow"}, ("/output/checkpoints", 500, False)),
    ({"checkpoint": VOLUME, "framework": "keras"}, (ROOT, 500, True)),
    ({"checkpoint": {**VOLUME, "enabled": True, "everySteps": 20}, "framework": "keras"}, (ROOT, 20, True)),
    ({"output": BLOB, "framework": "tensorflow", "checkpoint": {"enabled": False}}, None),
])
def test_checkpointing_is_on_by_default_where_checkpoints_outlive_the_pods(spec_, expected):
    ck = job(**spec_).checkpoint
    assert (ck and (ck.root, ck.every_steps, ck.on_claim)) == expected


@pytest.mark.parametrize("spec_,words", [
    ({"checkpoint": {"enabled": True}}, "spec.checkpoint.enabled: checkpoints need a place"),
    ({"checkpoint": {"enabled": True}, "framework": "tensorflow"}, "spec.checkpoint.enabled: checkpoints need a place"),
])
def test_checkpointing_that_cannot_work_is_refused_naming_the_field(spec_, words):
    with pytest.raises(spec.SpecError) as exc:
        job(**spec_)
    assert str(exc.value).startswith(words)


# ---- which reports are accepted -----------------------------------------------------------------
@pytest.mark.parametrize("value,accepted", [
    ({"step": 500, "time": "2026-11-26T10:00:00Z", "path": BLOB_PATH}, True),
    ({"step": 500, "path": f"{FOLDER}/3/output/checkpoints/attempt-3/step-500"}, True),
    ({"step": 499, "path": BLOB_PATH}, False),  # the step is not the folder's
    ({"step": 500, "path": "other/1/output/checkpoints/attempt-1/step-500"}, False),  # another job
    ({"step": 500, "path": f"{FOLDER}/1/output/checkpoints/attempt-2/step-500"}, False),  # attempts differ
    ({"step": 500, "path": f"{FOLDER}/1/output/checkpoints/attempt-1/step-500/../../../../x"}, False),
    ({"step": 500, "path": f"{FOLDER}/1/output/checkpoints/attempt-1/step-500/"}, False),
    # issue 22 M3: only this job's own folder, <namespace>/<name>-<uid8>
    ({"step": 500, "path": "j/1/output/checkpoints/attempt-1/step-500"}, False),  # the old, shared layout
    ({"step": 500, "path": f"other-ns/j-{UID[:8]}/1/output/checkpoints/attempt-1/step-500"}, False),  # namesake
    ({"step": 500, "path": "ns/j-0badc0de/1/output/checkpoints/attempt-1/step-500"}, False),  # an earlier j
    ({"step": "500", "path": BLOB_PATH}, False),
    ({"step": True, "path": BLOB_PATH}, False),
])
def test_blob_reports_are_accepted_only_inside_the_jobs_own_folder(value, accepted):
    found, refused = resume.accept(job(output=BLOB), report(EMPTY, **value))
    assert (found is not None, refused is None) == (accepted, accepted)
    if accepted:
        assert found["step"] == 500 and found["path"] == value["path"]
        assert found["url"] == f"https://a.blob.core.windows.net/results/{value['path']}/"
    else:
        assert "ignored" in refused


def test_volume_reports_are_accepted_only_under_the_jobs_own_root():
    j = job(checkpoint=VOLUME)
    ok, _ = resume.accept(j, report(EMPTY, step=7, path=f"{ROOT}/attempt-0/step-7"))
    assert ok == {"step": 7, "attempt": 0, "path": f"{ROOT}/attempt-0/step-7",
                  "url": f"pvc://ckpts/j-{UID[:8]}/attempt-0/step-7"}
    # the same claim, a job of the same name made before (another uid): never resumed from
    _, refused = resume.accept(j, report(EMPTY, step=7, path="/checkpoints/j-otheruid/attempt-0/step-7"))
    assert refused


def test_garbage_and_absent_reports():
    j = job(output=BLOB)
    assert resume.accept(j, EMPTY) == (None, None)
    assert resume.accept(j, None) == (None, None)
    cm = copy.deepcopy(EMPTY)
    cm["data"]["checkpoint"] = "x" * 5000
    assert resume.accept(j, cm)[1]
    cm["data"]["checkpoint"] = "{not json"
    assert resume.accept(j, cm)[1]


# ---- what the next attempt gets -----------------------------------------------------------------
def test_plan_blob_fetches_the_known_checkpoint_into_worker_0():
    j = job(output=BLOB)
    assert resume.plan(j, None) is None  # first attempt: a fresh start
    known = {"step": 500, "path": BLOB_PATH}
    assert resume.plan(j, known) == resume.Resume("/var/trainop/resume/step-500", fetch=BLOB_PATH)
    # status.checkpoint is the operator's own, but checked again all the same
    assert resume.plan(j, {"step": 500, "path": "elsewhere/step-500"}) is None


def test_plan_on_a_claim_resumes_from_the_known_one_else_the_newest_there():
    j = job(checkpoint=VOLUME)
    assert resume.plan(j, None) == resume.Resume("latest")
    known = {"step": 7, "path": f"{ROOT}/attempt-0/step-7"}
    assert resume.plan(j, known) == resume.Resume(f"{ROOT}/attempt-0/step-7")
    assert resume.plan(job(), None) is None


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_pods_are_told_where_to_save_and_what_to_resume_from():
    j = job(output=BLOB)
    plan = resume.Resume("/var/trainop/resume/step-500", fetch=BLOB_PATH)
    w0 = dtj.render_worker(j, 0, 2, resume=plan)
    launch = dtj.render_launcher(j, 2, resume=plan)
    for container in (w0["spec"]["containers"][0], launch["spec"]["template"]["spec"]["containers"][0]):
        env = env_of(container)
        assert env["TRAINOP_CHECKPOINT_DIR"] == "/output/checkpoints/attempt-2"
        assert env["TRAINOP_CHECKPOINT_EVERY"] == "500"
        assert env["TRAINOP_RESUME_FROM"] == "/var/trainop/resume/step-500"
    # mpirun forwards them to every rank
    script = launch["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "-x TRAINOP_RESUME_FROM" in script and "-x TRAINOP_CHECKPOINT_DIR" in script
    # worker 0 fetches before training: after the native sidecar, a plain init container
    fetch = w0["spec"]["initContainers"][1]
    assert fetch["name"] == "fetch-checkpoint"
    assert fetch["args"][-4:] == ["--fetch", BLOB_PATH, "--fetch-to", "/var/trainop/resume/step-500"]
    assert "restartPolicy" not in fetch
    assert {"name": "trainop-run", "mountPath": "/var/trainop"} in fetch["volumeMounts"]
    # other workers fetch nothing (rank 0 reads the checkpoint and broadcasts it)
    w1 = dtj.render_worker(j, 1, 2, resume=plan)
    assert all(c["name"] != "fetch-checkpoint" for c in w1["spec"].get("initContainers", []))
    # a TensorFlow job's ranks are told the same (the trainer's TF path saves and resumes alike)
    tf_launch = dtj.render_launcher(job(output=BLOB, framework="tensorflow"), 2, resume=plan)
    assert env_of(tf_launch["spec"]["template"]["spec"]["containers"][0])["TRAINOP_RESUME_FROM"] == \
        "/var/trainop/resume/step-500"
    # a first attempt: the variable is there, empty (one -x list for every attempt)
    assert env_of(dtj.render_worker(j, 0, 0)["spec"]["containers"][0])["TRAINOP_RESUME_FROM"] == ""


def test_checkpoint_volume_is_mounted_on_every_worker():
    j = job(checkpoint=VOLUME)
    for i in range(2):
        pod = dtj.render_worker(j, i, 0, resume=resume.Resume("latest"))
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpts"}} in pod["spec"]["volumes"]
        assert {"name": "checkpoints", "mountPath": "/checkpoints"} in pod["spec"]["containers"][0]["volumeMounts"]
        assert env_of(pod["spec"]["containers"][0])["TRAINOP_RESUME_FROM"] == "latest"
    assert "TRAINOP_CHECKPOINT_DIR" not in env_of(dtj.render_worker(job(), 0, 0)["spec"]["containers"][0])


# ---- jobsync: report -> status.checkpoint -> the next attempt ----------------------------------
def test_a_reported_checkpoint_lands_in_status_and_the_restarted_gang_resumes_from_it():
    cm = report(EMPTY, step=500, time="2026-11-26T10:00:00Z", path=f"{FOLDER}/0/output/checkpoints/attempt-0/step-500")
    running = snap(body(copy.deepcopy(RUNNING), output=BLOB), pods=workers(), launcher=launcher(),
                   **shared(), progress=cm)
    out = decide(running, CFG, NOW)
    assert out.status["checkpoint"] == {
        "step": 500, "attempt": 0, "time": "2026-11-26T10:00:00Z",
        "path": f"{FOLDER}/0/output/checkpoints/attempt-0/step-500",
        "url": f"https://a.blob.core.windows.net/results/{FOLDER}/0/output/checkpoints/attempt-0/step-500/"}
    assert out.events == []
    # the gang restarted: attempt 1's pods resume from it
    restarting = copy.deepcopy(RESTARTING) | {"checkpoint": out.status["checkpoint"]}
    again = decide(snap(body(restarting, output=BLOB), **shared(), progress=cm), CFG, NOW)
    assert attempt(again.status) == 1
    pods = [a.obj for a in again.actions if a.obj.get("kind") == "Pod"]
    assert len(pods) == 2
    for p in pods:
        env = env_of(p["spec"]["containers"][0])
        assert env["TRAINOP_RESUME_FROM"] == "/var/trainop/resume/step-500"
        assert env["TRAINOP_CHECKPOINT_DIR"] == "/output/checkpoints/attempt-1"
    assert pods[0]["spec"]["initContainers"][1]["args"][-3] == f"{FOLDER}/0/output/checkpoints/attempt-0/step-500"


def test_a_foreign_checkpoint_is_ignored_with_one_warning_and_the_known_one_kept():
    known = {"step": 5, "attempt": 0, "path": f"{FOLDER}/0/output/checkpoints/attempt-0/step-5"}
    status = copy.deepcopy(RUNNING) | {"checkpoint": known}
    cm = report(EMPTY, step=9, path="victim/0/output/checkpoints/attempt-0/step-9")
    out = decide(snap(body(status, output=BLOB), pods=workers(), launcher=launcher(), **shared(),
                      progress=cm), CFG, NOW)
    assert out.status["checkpoint"] == known
    assert [(kind, reason) for kind, reason, _ in out.events] == [("Warning", "CheckpointRejected")]
    # the same report again: no second Event
    again = decide(snap(body(out.status, output=BLOB), pods=workers(), launcher=launcher(), **shared(),
                        progress=cm), CFG, NOW)
    assert again.events == []


def test_resuming_a_suspended_job_resumes_from_its_checkpoint_in_the_same_attempt_folder():
    from tests.unit.test_jobsync_decide import cond
    known = {"step": 30, "attempt": 0, "path": f"{FOLDER}/0/output/checkpoints/attempt-0/step-30"}
    suspended = {"phase": "Suspended", "restarts": 0, "checkpoint": known,
                 "conditions": cond(("Created", True, "ChildrenCreated"), ("Suspended", True, "JobSuspended"),
                                    ("Admitted", False, "JobSuspended"))}
    out = decide(snap(body(suspended, output=BLOB), **shared(), progress=EMPTY), CFG, NOW)
    pods = [a.obj for a in out.actions if a.obj.get("kind") == "Pod"]
    assert len(pods) == 2 and out.status["checkpoint"] == known
    env = env_of(pods[0]["spec"]["containers"][0])
    assert env["TRAINOP_CHECKPOINT_DIR"] == "/output/checkpoints/attempt-0"
    assert env["TRAINOP_RESUME_FROM"] == "/var/trainop/resume/step-30"


def test_the_fetched_copy_is_where_the_trainer_accepts_it():
    """One contract in two packages: the trainer resumes only from its checkpoint root or the
    folder the operator's fetch-checkpoint init container fills."""
    from trainop_trainer import checkpoint

    assert resume.RESUME_DIR == checkpoint.FETCHED


def test_a_job_recreated_under_its_name_gets_its_own_folders_not_the_cached_ones():
    """parse_cached is keyed by the spec's text and the uid: a job re-created with the same name
    and spec must not get the first one's checkpoint root and blob folder from the memo."""
    from trainop.memo import Memos
    from trainop.render import logship

    memo = Memos()
    first, again = body(output=BLOB), body(output=BLOB)
    again["metadata"]["uid"] = "0badc0de-2"
    a, b = spec.parse_cached(first, CFG, memo), spec.parse_cached(again, CFG, memo)
    assert logship.job_folder(a) == FOLDER and logship.job_folder(b) == "ns/j-0badc0de"
    claim = [body(checkpoint=VOLUME), body(checkpoint=VOLUME)]
    claim[1]["metadata"]["uid"] = "0badc0de-2"
    assert [spec.parse_cached(c, CFG, memo).checkpoint.root for c in claim] == [ROOT, "/checkpoints/j-0badc0de"]
