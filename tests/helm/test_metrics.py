"""trainop.metrics as the handlers use it: watch events -> gauges and counters (the initial
listing is a baseline), reconcile timing and error counting. Real prometheus_client registry."""

from __future__ import annotations

import re
import secrets

import prometheus_client as prom
import pytest

from tests.helm.helm import CHART
from trainop import metrics


def sample(name: str, **labels) -> float:
    return prom.REGISTRY.get_sample_value(name, labels) or 0.0


def body(ns: str, uid: str, **status) -> dict:
    return {"metadata": {"namespace": ns, "uid": uid}, "status": status}


@pytest.fixture
def ns() -> str:  # a label value no other test touches: samples start at zero
    return f"ns-{secrets.token_hex(4)}"


def test_job_phases_restarts_and_deletion(ns):
    job = metrics.JOB_KIND
    succeeded = sample("trainop_phase_transitions_total", kind=job, phase="Succeeded")
    metrics.observe(job, body(ns, "a", phase="Running", restarts=2))  # initial listing: baseline
    metrics.observe(job, body(ns, "b"))
    assert sample("trainop_jobs", namespace=ns, phase="Running") == 1
    assert sample("trainop_jobs", namespace=ns, phase="New") == 1
    assert sample("trainop_gang_restarts_total", namespace=ns) == 0
    # an int status.restarts (written before it had two counters) was the attempt
    metrics.observe(job, body(ns, "a", phase="Starting", attempt=3, restarts={"failures": 2, "disruptions": 1}))
    metrics.observe(job, body(ns, "a", phase="Succeeded", attempt=3, restarts={"failures": 2, "disruptions": 1}))
    metrics.observe(job, body(ns, "b", phase="Pending"))
    assert sample("trainop_gang_restarts_total", namespace=ns) == 1
    assert sample("trainop_phase_transitions_total", kind=job, phase="Succeeded") == succeeded + 1
    assert sample("trainop_jobs", namespace=ns, phase="Succeeded") == 1
    assert sample("trainop_jobs", namespace=ns, phase="Running") == 0
    metrics.observe(job, body(ns, "a", phase="Succeeded"), deleted=True)
    assert sample("trainop_jobs", namespace=ns, phase="Succeeded") == 0
    assert sample("trainop_jobs", namespace=ns, phase="Pending") == 1


def test_staging_bytes_count_increases_only(ns):
    stage = metrics.STAGE_KIND
    metrics.observe(stage, body(ns, "s", phase="Copying", bytesCopied=100))
    metrics.observe(stage, body(ns, "s", phase="Copying", bytesCopied=1_000))
    metrics.observe(stage, body(ns, "s", phase="Copying", bytesCopied=400))  # a new copy Job starts over
    metrics.observe(stage, body(ns, "s", phase="Ready", bytesCopied=1_400))
    assert sample("trainop_staging_bytes_copied_total", namespace=ns) == 900 + 1_000
    assert sample("trainop_datastages", namespace=ns, phase="Ready") == 1
    assert sample("trainop_jobs", namespace=ns, phase="Ready") == 0


def test_reconcile_times_and_counts_errors():
    kind = f"Kind{secrets.token_hex(3)}"
    with metrics.reconcile(kind):
        pass
    with pytest.raises(ConnectionError), metrics.reconcile(kind):
        raise ConnectionError("api down")
    assert sample("trainop_reconcile_duration_seconds_count", kind=kind) == 2
    assert sample("trainop_reconcile_errors_total", kind=kind, error="ConnectionError") == 1


def test_the_chart_readme_names_every_metric_with_its_labels(ns):
    """charts/trainop/README.md's list is what the registry really exports (a counter under its
    exposed name, `_total`), so a metric added to metrics.py must be added there too."""
    readme = (CHART / "README.md").read_text()
    # a sample of every family, so that each shows its labels
    for kind in (metrics.JOB_KIND, metrics.STAGE_KIND):
        metrics.observe(kind, body(ns, kind, phase="Running"))
        metrics.observe(kind, body(ns, kind, phase="Succeeded", attempt=1, bytesCopied=1))
        with pytest.raises(ValueError), metrics.reconcile(kind):
            raise ValueError("counted")
    metrics.queue_totals(ns, {"queuedJobs": 1, "queuedGpus": 8, "admittedGpus": 8})
    for family in prom.REGISTRY.collect():
        if not family.name.startswith("trainop_"):
            continue
        exposed = family.name + ("_total" if family.type == "counter" else "")
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        shown = re.search(rf"`{exposed}(\{{([a-z_,]*)\}})?`", readme)
        assert shown, f"{exposed} is missing from charts/trainop/README.md"
        assert sorted(filter(None, (shown.group(2) or "").split(","))) == labels, \
            f"charts/trainop/README.md: {exposed} has the labels {{{','.join(labels)}}}"
