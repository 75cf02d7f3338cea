"""Prometheus metrics of the operator (prometheus_client, its default registry).

`trainop operator --metrics-port 9090` serves them at http://<host>:9090/metrics (the chart's
metrics Service and optional ServiceMonitor point there). Without the flag nothing listens.

Metrics
    trainop_jobs{namespace,phase}                     gauge    DistributedTrainingJobs by status.phase
    trainop_datastages{namespace,phase}               gauge    DataStages by status.phase
    trainop_phase_transitions_total{kind,phase}       counter  objects entering a phase
    trainop_gang_restarts_total{namespace}            counter  gang restarts (status.attempt went up)
    trainop_staging_bytes_copied_total{namespace}     counter  bytes the copy Jobs reported copied
    trainop_reconcile_duration_seconds{kind}          histogram one reconcile (handlers' sync call)
    trainop_reconcile_errors_total{kind,error}        counter  reconciles that raised (error: class)
    trainop_queued_jobs{namespace}                    gauge    jobs waiting for GPU quota (native admission)
    trainop_queued_gpus{namespace}                    gauge    GPUs the queued jobs ask for
    trainop_admitted_gpus{namespace}                  gauge    GPUs of admitted, unfinished jobs
A phase not yet written by the operator counts as "New". Gauges hold what this process has seen
since it started; counters count only changes seen while it runs (the initial listing after a
restart is a baseline, not a transition), as Prometheus expects of counters.

What other modules call
    with metrics.reconcile("DistributedTrainingJob"):   # around one reconcile (controller.py); times it and
        ...                                             # counts an exception as an error
    metrics.observe(kind, body, deleted=False)          # every watch event of a DTJ/DataStage;
                                                        # handlers/indexes.py's routers feed it
    metrics.queue_totals(namespace, totals)             # gate.py after judging a namespace's queue
    metrics.serve(port, address="0.0.0.0")              # start the HTTP endpoint (cli/operator.py)
Everything is thread-safe: reconciles run in the controller's thread pool.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter as _Tally

import prometheus_client as prom
from prometheus_client.core import GaugeMetricFamily

from trainop.jobsync import attempt

NEW = "New"
JOB_KIND, STAGE_KIND = "DistributedTrainingJob", "DataStage"

PHASE_TRANSITIONS = prom.Counter(
    "trainop_phase_transitions", "Objects entering a phase (seen while this operator runs)",
    ["kind", "phase"])
GANG_RESTARTS = prom.Counter(
    "trainop_gang_restarts", "Gang restarts of DistributedTrainingJobs (status.attempt increments)",
    ["namespace"])
STAGING_BYTES = prom.Counter(
    "trainop_staging_bytes_copied", "Bytes copied from Blob Storage by DataStage copy Jobs",
    ["namespace"])
RECONCILE_SECONDS = prom.Histogram(
    "trainop_reconcile_duration_seconds", "Duration of one reconcile", ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RECONCILE_ERRORS = prom.Counter(
    "trainop_reconcile_errors", "Reconciles that raised an exception", ["kind", "error"])
QUEUED_JOBS = prom.Gauge("trainop_queued_jobs", "Jobs waiting for GPU quota (native admission)",
                         ["namespace"])
QUEUED_GPUS = prom.Gauge("trainop_queued_gpus", "GPUs the queued jobs ask for", ["namespace"])
ADMITTED_GPUS = prom.Gauge("trainop_admitted_gpus",
                           "GPUs of admitted, unfinished jobs (native admission)", ["namespace"])


class _Seen:
    """The last phase/restarts/bytes seen per object uid; exported as the per-phase gauges."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[str, str, str, int, int]] = {}  # uid -> kind, ns, phase, restarts, bytes

    def update(self, kind: str, body: dict, deleted: bool) -> None:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        uid, namespace = meta.get("uid"), meta.get("namespace") or ""
        if not uid:
            return
        phase = status.get("phase") or NEW
        restarts = attempt(status)  # every restart, counted or not
        copied = int(status.get("bytesCopied") or 0)
        with self.lock:
            before = self.objects.pop(uid, None)
            if not deleted:
                self.objects[uid] = (kind, namespace, phase, restarts, copied)
        if before is None or deleted:
            return  # first sight is the baseline
        _, _, old_phase, old_restarts, old_copied = before
        if phase != old_phase:
            PHASE_TRANSITIONS.labels(kind, phase).inc()
        if restarts > old_restarts:
            GANG_RESTARTS.labels(namespace).inc(restarts - old_restarts)
        if copied > old_copied:  # a re-run copy restarts its count: no negative increments
            STAGING_BYTES.labels(namespace).inc(copied - old_copied)

    def collect(self):
        with self.lock:
            tally = _Tally((kind, ns, phase) for kind, ns, phase, _, _ in self.objects.values())
        for kind, name, doc in ((JOB_KIND, "trainop_jobs", "DistributedTrainingJobs by phase"),
                                (STAGE_KIND, "trainop_datastages", "DataStages by phase")):
            family = GaugeMetricFamily(name, doc, labels=["namespace", "phase"])
            for (k, ns, phase), count in sorted(tally.items()):
                if k == kind:
                    family.add_metric([ns, phase], count)
            yield family


_SEEN = _Seen()
prom.REGISTRY.register(_SEEN)


def observe(kind: str, body: dict, deleted: bool = False) -> None:
    """Record one watch event of `kind` (JOB_KIND or STAGE_KIND)."""
    _SEEN.update(kind, body, deleted)


@contextlib.contextmanager
def reconcile(kind: str):
    """Time the block as one reconcile of `kind`; an exception is counted, then re-raised."""
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:
        RECONCILE_ERRORS.labels(kind, type(exc).__name__).inc()
        raise
    finally:
        RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - start)


def queue_totals(namespace: str, totals: dict[str, int]) -> None:
    """The namespace's queue as admission.gpu_totals() counted it; nothing for a namespace
    whose queue was never judged (no quota limits it: gate.totals gives {})."""
    if not totals:
        return
    QUEUED_JOBS.labels(namespace).set(totals["queuedJobs"])
    QUEUED_GPUS.labels(namespace).set(totals["queuedGpus"])
    ADMITTED_GPUS.labels(namespace).set(totals["admittedGpus"])


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Serve /metrics from a daemon thread (prometheus_client's own HTTP server)."""
    prom.start_http_server(port, addr=address)
