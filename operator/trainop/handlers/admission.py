"""Kueue's side of a job's ending: a finished job that Kueue admitted marks its Workload
Finished (kueue.finish); a suspended one gives its Workload up (kueue.release) and queues again
when resumed. Only jobs that name a queue reach the API here; native admission is gate.py,
woken through handlers/indexes.py.
"""

from __future__ import annotations

import kopf

from trainop import GROUP, VERSION, kueue, phases
from trainop.spec import MANAGED_BY, managed_by


def _named_queue(body, **_) -> bool:
    return bool((body.get("spec") or {}).get("queue")) and managed_by(body) == MANAGED_BY


@kopf.on.event(GROUP, VERSION, "distributedtrainingjobs", when=_named_queue)
def kueue_job_changed(body: kopf.Body, namespace: str, **_) -> None:
    if not kueue.installed():
        return
    spec, phase = body.get("spec") or {}, (body.get("status") or {}).get("phase")
    name = body["metadata"]["name"]
    if phase == "Suspended" and (spec.get("runPolicy") or {}).get("suspend"):
        kueue.release(namespace, name)  # (not once resumed: its new Workload must stay)
    elif phase in phases.TERMINAL:
        kueue.finish(namespace, name, phase == "Succeeded")
