"""kopf handlers that re-judge queued jobs the moment room may have appeared: a ResourceQuota
changed (raised, or its `used` went down because pods went away), a job finished, was
suspended or deleted, a job's pod finished or was deleted (what frees a namespace's GPU cap, which no quota
counts). The decision itself is gate.wake() -> admission.plan(); these only route events.

A finished job that Kueue admitted marks its Workload Finished here (kueue.finish); a suspended
one gives its Workload up (kueue.release) and queues again when resumed.
"""

from __future__ import annotations

import kopf

from trainop import GROUP, VERSION, gate, kueue
from trainop.render import common

TERMINAL = ("Succeeded", "Failed")


@kopf.on.event("v1", "resourcequotas")
def quota_changed(namespace: str, memo: kopf.Memo, **_) -> None:
    gate.wake(namespace, memo.config)


@kopf.on.event(GROUP, VERSION, "distributedtrainingjobs")
def job_changed(event: dict, body: kopf.Body, namespace: str, memo: kopf.Memo, **_) -> None:
    spec, phase = body.get("spec") or {}, (body.get("status") or {}).get("phase")
    suspended = phase == "Suspended" and (spec.get("runPolicy") or {}).get("suspend")
    queued_in_kueue = bool(spec.get("queue")) and kueue.installed()
    if queued_in_kueue and suspended:  # (not once resumed: its new Workload must stay)
        kueue.release(namespace, body["metadata"]["name"])
    if event.get("type") == "DELETED" or phase in TERMINAL or suspended:
        if phase in TERMINAL and queued_in_kueue:
            kueue.finish(namespace, body["metadata"]["name"], phase == "Succeeded")
        gate.wake(namespace, memo.config)


@kopf.on.event("v1", "pods", labels={common.LABEL_JOB: kopf.PRESENT})
def pod_changed(event: dict, body: kopf.Body, namespace: str, memo: kopf.Memo, **_) -> None:
    if event.get("type") == "DELETED" or (body.get("status") or {}).get("phase") in TERMINAL:
        gate.wake(namespace, memo.config)
