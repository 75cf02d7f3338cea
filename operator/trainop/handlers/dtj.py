"""kopf handlers for DistributedTrainingJob: one timer per job runs jobsync.sync() (level-based:
it re-derives everything from the live objects), writes the status once if it changed, posts
an Event per transition, and raises TemporaryError(delay=...) while the job waits on something.

A timer rather than change handlers: the gang's state lives in its pods and launcher Job, not in
the job's spec, and one serial loop per job can never race itself.
"""

from __future__ import annotations

import copy

import kopf

from trainop import GROUP, VERSION, config, jobsync, kube, metrics

PLURAL = "distributedtrainingjobs"
# The steady-state pace (a Running job, a finished job awaiting cleanup or TTL); waits use the
# configuration's resyncSeconds through TemporaryError(delay=...).
INTERVAL = config.load().resync_seconds


# backoff: an unexpected error (API hiccup) is retried soon, not after kopf's default minute.
@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL, backoff=5)
def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger, **_) -> None:
    obj = copy.deepcopy(dict(body))
    with metrics.reconcile(metrics.JOB_KIND):
        result = jobsync.sync(obj, memo.config)
    for type_, reason, message in result.events:
        kopf.event(body, type=type_, reason=reason, message=message)
    old = obj.get("status") or {}
    for key in set(old) | set(result.status):
        if old.get(key) != result.status.get(key):
            patch.status[key] = result.status.get(key)
    if result.delete_job:
        logger.info("ttlSecondsAfterFinished elapsed: deleting the job")
        kube.delete(obj["apiVersion"], obj["kind"], body["metadata"]["name"],
                    body["metadata"]["namespace"], uid=body["metadata"]["uid"])
    elif result.wait:
        raise kopf.TemporaryError(result.wait, delay=result.delay or INTERVAL)
