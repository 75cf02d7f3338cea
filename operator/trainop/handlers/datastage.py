"""kopf handlers for DataStage: a timer runs stagesync.sync() (level-based, from the live
objects), writes the operator's status keys once if they changed, posts an Event per phase
change, and raises TemporaryError while the server starts or the copy runs. The delete handler
(kopf adds the finalizer because it exists) removes the cluster-scoped PersistentVolume.
"""

from __future__ import annotations

import copy

import kopf

from trainop import GROUP, VERSION, config, metrics, stagesync

PLURAL = "datastages"
INTERVAL = config.load().resync_seconds


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL)
def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_) -> None:
    obj = copy.deepcopy(dict(body))
    with metrics.reconcile(metrics.STAGE_KIND):
        result = stagesync.sync(obj, memo.config)
    for type_, reason, message in result.events:
        kopf.event(body, type=type_, reason=reason, message=message)
    old = obj.get("status") or {}
    for key, value in result.status.items():
        if old.get(key) != value:
            patch.status[key] = value
    if result.wait:
        raise kopf.TemporaryError(result.wait, delay=INTERVAL)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def cleanup(body: kopf.Body, **_) -> None:
    stagesync.cleanup(dict(body))
