"""THE entry module: `trainop operator` runs kopf with this module, and so do the Helm chart's
Deployment and the test fixture. It imports every handler module and sets kopf's settings.

To add a resource's handlers, add one import line below.
"""

from __future__ import annotations

import logging

import kopf

from trainop import config, kube
from trainop.handlers import admission  # noqa: F401  (re-judges queued jobs on events)
from trainop.handlers import dtj  # noqa: F401  (registers the DistributedTrainingJob handlers)
from trainop.handlers import datastage  # noqa: F401  (registers the DataStage handlers)
from trainop.handlers import metrics  # noqa: F401  (watch events -> Prometheus gauges)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger,
              **_) -> None:
    memo.config = config.load()
    kube.configure()
    # Kopf's bookkeeping goes to annotations under our group, never into our status schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="trainop.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="trainop.io", key="last-handled-configuration")
    settings.persistence.finalizer = "trainop.io/finalizer"
    # Events come from jobsync (one per condition transition) through kopf.event(); kopf's own
    # log lines ("failed temporarily" while a job waits) must not become Events.
    settings.posting.level = logging.CRITICAL
    settings.watching.server_timeout = 300
    settings.networking.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.execution.max_workers = 16
    # A deleted object's finalizer waits for its timer to stop; kopf re-checks a timer that was
    # mid-run only every cancellation_polling seconds (default 60), so deletions lagged a minute.
    settings.background.cancellation_polling = 1
    logger.info("trainop operator configured: %d node pools, resync %.1fs",
                len(memo.config.node_pools), memo.config.resync_seconds)
