"""kopf watchers that feed trainop.metrics: every watch event of a DistributedTrainingJob or a
DataStage (the initial listing included) updates the per-phase gauges and the counters.
Watch events rather than calls from the reconcilers: the gauges then follow what the API
server holds, also for objects the timers have not reached yet.
"""

from __future__ import annotations

import logging

import kopf

from trainop import GROUP, VERSION, metrics

_QUIET = ("Handler 'job_event' succeeded.", "Handler 'stage_event' succeeded.")


def _not_routine(record: logging.LogRecord) -> bool:
    """kopf logs every handler's success at INFO: for these watchers that is a line per watch
    event of every object, which says nothing; failures are still logged."""
    return record.getMessage() not in _QUIET


logging.getLogger("kopf.objects").addFilter(_not_routine)


# async, though they do no I/O: kopf runs a plain `def` handler in a thread of its executor,
# a thread hop on every job's every watch event (1% of the operator's CPU at 500 jobs).
@kopf.on.event(GROUP, VERSION, "distributedtrainingjobs")
async def job_event(body: kopf.Body, type: str | None, **_) -> None:  # noqa: A002 (kopf's kwarg name)
    metrics.observe(metrics.JOB_KIND, body, deleted=type == "DELETED")


@kopf.on.event(GROUP, VERSION, "datastages")
async def stage_event(body: kopf.Body, type: str | None, **_) -> None:  # noqa: A002
    metrics.observe(metrics.STAGE_KIND, body, deleted=type == "DELETED")
