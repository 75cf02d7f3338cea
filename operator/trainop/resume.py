"""Which checkpoint the next attempt of a gang resumes from. Pure: the parsed job and what the
log shipper reported in, a decision out.

How the operator learns of a checkpoint: worker 0's log shipper sees the trainer complete
`<root>/attempt-<n>/step-<k>` (uploads it first with Blob output) and patches the key
`checkpoint` of the job's progress ConfigMap with `{"step", "time", "path", "saveSeconds"}`. That ConfigMap is
written by job code's neighbour (docs/security.md, "What job code can do"), so the report is
untrusted: `accept()` takes it only when its path lies in this job's own checkpoint location
(the job's blob folder `<prefix>/<namespace>/<job>-<uid8>/<attempt>/output/checkpoints/attempt-<attempt>/step-<k>`,
or `<root>/attempt-<n>/step-<k>` on the checkpoint claim) and its step is the folder's; the
worst a forged report can do is make this job resume from another of its own checkpoints.

`plan()` turns the accepted checkpoint (status.checkpoint) into what the next attempt's pods
get: TRAINOP_RESUME_FROM, and for Blob output the blob folder that worker 0's init container
fetches into RESUME_DIR before the trainer starts. On a claim, with nothing reported (no log
shipper without Blob output), the trainer is told `latest`: it takes the newest complete
checkpoint under the job's own root itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from trainop.spec import Job

CHECKPOINT_KEY = "checkpoint"  # the progress ConfigMap's key beside `metrics` (render/logship.py)
RESUME_DIR = "/var/trainop/resume"  # worker 0's fetched copy (the log shipper's emptyDir)
LATEST = "latest"
MAX_REPORT = 2048
MAX_SAVE_SECONDS = 86400  # a report's saveSeconds above it is ignored (the CRD's grace maximum)
_NUM = r"(0|[1-9][0-9]{0,11})"


@dataclass(frozen=True)
class Resume:
    """What the next attempt gets."""
    resume_from: str  # TRAINOP_RESUME_FROM: a folder in the pod, or LATEST
    fetch: str | None = None  # blob folder worker 0 downloads into `resume_from` first


def _shape(job: Job) -> re.Pattern | None:
    ck = job.checkpoint
    if ck is None:
        return None
    if ck.on_claim:
        return re.compile(re.escape(ck.root) + rf"/attempt-(?P<a>{_NUM})/step-(?P<k>{_NUM})")
    from trainop.render.logship import job_folder  # render/logship imports this module

    base = re.escape(job_folder(job))
    return re.compile(base + rf"/(?P<a>{_NUM})/output/checkpoints/attempt-(?P=a)/step-(?P<k>{_NUM})")


def accept(job: Job, config_map: dict | None) -> tuple[dict | None, str | None]:
    """(status.checkpoint from the shipper's report, or None; a warning when a report was
    refused, naming why). No report: (None, None)."""
    text = ((config_map or {}).get("data") or {}).get(CHECKPOINT_KEY)
    shape = _shape(job)
    if not text or shape is None:
        return None, None
    try:
        report = json.loads(text) if len(text) <= MAX_REPORT else None
    except ValueError:
        report = None
    if not isinstance(report, dict) or not isinstance(report.get("path"), str) or \
            not isinstance(report.get("step"), int) or isinstance(report.get("step"), bool):
        return None, "the checkpoint report in the progress ConfigMap is not {step, time, path}; ignored"
    path = report["path"]
    m = shape.fullmatch(path)
    if m is None or int(m["k"]) != report["step"]:
        return None, (f"checkpoint {path[:300]!r} is not a step-<k> folder in this job's own checkpoint "
                      f"location (step {report['step']}); ignored")
    out = {"step": report["step"], "attempt": int(m["a"]), "path": path}
    if isinstance(report.get("time"), str) and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", report["time"]):
        out["time"] = report["time"]
    seconds = report.get("saveSeconds")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds <= MAX_SAVE_SECONDS:
        out["saveSeconds"] = round(float(seconds), 1)
    out["url"] = url(job, path)
    return out, None


def slowest_save(found: dict, known: dict | None) -> dict:
    """`found` (accept's) with `saveSeconds` the slowest save reported for this job, this one
    or an earlier one (`known`: the status.checkpoint before it): a grace period sized from a
    fast save loses the checkpoint when a slow one comes (a busy file system), while one sized
    from a slow save costs nothing when the save is fast (the pod ends when its processes do).
    The admin's cap (render/dtj.py, save_grace) bounds what an outlier or a forged report does."""
    seen = [s for s in (found.get("saveSeconds"), (known or {}).get("saveSeconds"))
            if isinstance(s, (int, float)) and not isinstance(s, bool)]
    return {**found, "saveSeconds": max(seen)} if seen else found


def url(job: Job, path: str) -> str:
    if job.checkpoint.on_claim:
        claim = job.checkpoint.claim or job.output.claim
        mount = "/checkpoints" if job.checkpoint.claim else "/output"
        return f"pvc://{claim}/{path.removeprefix(mount + '/')}"
    return f"{job.output.account_url}/{job.output.container}/{path}/"


def plan(job: Job, known: dict | None) -> Resume | None:
    """What the next attempt resumes from: the accepted checkpoint, else `latest` on a claim,
    else nothing (a fresh start)."""
    ck = job.checkpoint
    if ck is None:
        return None
    if known and isinstance(known.get("path"), str) and _shape(job).fullmatch(known["path"]):
        if ck.on_claim:
            return Resume(known["path"])
        return Resume(f"{RESUME_DIR}/step-{known['step']}", fetch=known["path"])
    if ck.on_claim:
        return Resume(LATEST)
    return None
