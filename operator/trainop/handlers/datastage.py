"""The DataStage's finalizer: its PersistentVolume is cluster-scoped, so no owner reference
removes it; kopf adds the finalizer because this delete handler exists. (The reconcile is
controller.py's, woken by handlers/indexes.py.)"""

from __future__ import annotations

import kopf

from trainop import GROUP, VERSION, stagesync


@kopf.on.delete(GROUP, VERSION, "datastages")
def cleanup(body: kopf.Body, **_) -> None:
    stagesync.cleanup(dict(body))
