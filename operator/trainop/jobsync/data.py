"""The job's data and what it reports: the DataStage's claim (a started job keeps its claim),
the checkpoint the shipper reported (resume.accept), its metrics and progress for display.
"""

from __future__ import annotations

import dataclasses

from trainop import conditions, progress, resume
from trainop.config import Config
from trainop.jobsync.model import JobSnapshot, _Status
from trainop.render import logship
from trainop.spec import Job, SpecError, parse_cached


def _data_claim(stage: dict | None, job: Job, st: _Status, pods: list[dict]):
    """The DataStage's claim name, None for synthetic data, False while waiting.

    A job starts only on a Ready DataStage. Once it has started (DataReady was True), it keeps
    the claim it started with whatever happens to the DataStage afterwards (its Secret deleted,
    its spec edited and copying again, Failed, even deleted: the claim stays while pods use
    it), so a running job is never frozen and a restart of its gang mounts the same claim. A job
    that has not started yet waits for Ready again, so it never begins on a share being
    rewritten."""
    if not job.data_stage:
        return None
    field_ = "spec.data.dataStageRef.name"
    phase = ((stage or {}).get("status") or {}).get("phase") or ("Pending" if stage else "gone")
    if st.is_true("DataReady") and phase != "Ready":
        claim = ((stage or {}).get("status") or {}).get("claimName") or _mounted_claim(pods)
        if claim:
            st.cond("DataReady", True, "DataStageChanged",
                    f"DataStage {job.data_stage} is {phase}; this job keeps claim {claim}, which "
                    f"it started with (new jobs wait until the DataStage is Ready)")
            return claim
    if stage is None:
        st.cond("DataReady", False, "DataStageNotFound",
                f"{field_}: DataStage {job.data_stage!r} does not exist in namespace "
                f"{job.namespace}; create it or fix the name")
    else:
        phase = (stage.get("status") or {}).get("phase") or "Pending"
        claim = (stage.get("status") or {}).get("claimName")
        if phase == "Ready" and claim:
            st.cond("DataReady", True, "DataStageReady",
                    f"DataStage {job.data_stage} is Ready; claim {claim} mounted read-only at "
                    f"{job.data_mount_path}")
            return claim
        st.cond("DataReady", False,
                "DataStageFailed" if phase == "Failed" else "WaitingForDataStage",
                f"DataStage {job.data_stage} is {phase}; the job starts when it is Ready")
    st.phase("Staging" if stage is not None else "Pending")
    return False


def _mounted_claim(pods: list[dict]) -> str | None:
    """The data claim a pod of this job mounts (when the DataStage no longer says it)."""
    for pod in pods:
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            if volume.get("name") == "data" and volume.get("persistentVolumeClaim"):
                return volume["persistentVolumeClaim"].get("claimName")
    return None


def _take_checkpoint(snap: JobSnapshot, cfg: Config, st: _Status) -> None:
    """The checkpoint the log shipper reported (resume.accept: only one in this job's own
    location) into `status.checkpoint`, which the next attempt resumes from (resume.plan). A
    refused report leaves the known one in place and says why (a Warning, once per reason)."""
    try:
        job = parse_cached(snap.body, cfg, snap.memo)
    except SpecError:
        return
    if job.checkpoint is None:
        return
    found, refused = resume.accept(job, snap.progress)
    if refused:
        st.cond("CheckpointAccepted", False, "CheckpointRejected", refused)
    elif found:
        st.data["checkpoint"] = resume.slowest_save(found, st.data.get("checkpoint"))
        if conditions.get_condition(st.data.get("conditions"), "CheckpointAccepted"):
            st.cond("CheckpointAccepted", True, "CheckpointReported",
                    f"step {found['step']} at {found['url']}")


def _with_save(job: Job, st: _Status) -> Job:
    """The job with its slowest checkpoint save (status.checkpoint.saveSeconds) bound, which
    its pods' grace period is sized from (render/dtj.py save_grace). Bound only where pods are
    rendered to be created or deleted, never where the gang is rendered for admission or
    Kueue's pod sets: a new measure changes no reservation."""
    seconds = (st.data.get("checkpoint") or {}).get("saveSeconds")
    if job.checkpoint is None or not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return job
    return dataclasses.replace(job, save_seconds=float(seconds))


def _show_metrics(snap: JobSnapshot, st: _Status) -> None:
    """The log shipper's latest report into `status.metrics`, and what it says of progress
    (percent, throughput, ETA: progress.py) into `status.progress`, for people, `trainop get`
    and kubectl's columns. Display only: the shipper writes its own ConfigMap, never this job's
    status, and nothing decided here reads `metrics` or `progress` (docs/security.md; the
    stall check reads the report's step from the ConfigMap itself, jobsync/stall.py). Copied
    also once the job is over, since the final report may land after the launcher completed;
    an ETA only while the job runs."""
    metrics = logship.progress_metrics(snap.progress)
    if metrics is not None:
        st.data["metrics"] = metrics
        shown = progress.compute(metrics, running=st.data.get("phase") == "Running")
        if shown is not None:
            st.data["progress"] = shown
        else:
            st.data.pop("progress", None)
