"""bench/control_plane.py's reading of the API server's audit log: each job's path, step by step
(`audit_path`, `audit_latencies`), from an audit log written here in the API server's own format."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "control_plane.py"
NS = "bench-trainop-10"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("control_plane", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def event(at: float, verb: str, resource: str, name: str, agent: str, sub: str | None = None,
          code: int = 201, stage: str = "ResponseComplete", namespace: str = NS) -> dict:
    ref = {"resource": resource, "namespace": namespace, "name": name}
    if sub:
        ref["subresource"] = sub
    seconds, fraction = divmod(at, 1)
    return {"stage": stage, "verb": verb, "userAgent": agent, "objectRef": ref,
            "responseStatus": {"code": code},
            "requestReceivedTimestamp": f"2026-12-07T16:00:{int(seconds):02d}.{round(fraction * 1e6):06d}Z"}


def job_events(job: str, t0: float) -> list[dict]:
    """One job's path: applied at t0, then each step 0.1 s after the one before."""
    op, kwok = "trainop/bench_x", "kwok/v0.7"
    return [
        event(t0, "create", "distributedtrainingjobs", job, "trainop-bench"),
        event(t0 + 0.1, "create", "networkpolicies", job, op),
        event(t0 + 0.15, "create", "pods", f"{job}-worker-0", op),
        event(t0 + 0.2, "create", "pods", f"{job}-worker-1", op),  # the last worker: the step's end
        event(t0 + 0.25, "patch", "pods", f"{job}-worker-0", kwok, sub="status", code=200),
        event(t0 + 0.3, "patch", "pods", f"{job}-worker-1", kwok, sub="status", code=200),
        event(t0 + 0.35, "patch", "pods", f"{job}-worker-1", kwok, sub="status", code=200),  # not the first
        event(t0 + 0.4, "create", "jobs", f"{job}-launcher", op),
        event(t0 + 0.5, "create", "pods", f"{job}-launcher-x7k2p", "kube-scheduler/v1.35", sub="binding"),
        event(t0 + 0.6, "patch", "pods", f"{job}-launcher-x7k2p", kwok, sub="status", code=200),
    ]


def test_each_jobs_path_and_the_median_of_each_step(bench, tmp_path):
    log = tmp_path / "audit.jsonl"
    noise = [
        event(0.0, "create", "pods", "j0000-worker-0", "trainop/x", stage="RequestReceived"),  # not complete
        event(0.0, "create", "pods", "j0000-worker-0", "trainop/x", code=409),  # refused: nothing created
        event(0.0, "create", "pods", "j0000-worker-0", "trainop/x", namespace="other"),  # another run
        event(0.0, "create", "events", "j0000.18a2", "trainop/x"),  # an Event: not a child
    ]
    events = job_events("j0000", 1.0) + job_events("j0001", 1.05) + noise
    log.write_text("".join(json.dumps(e) + "\n" for e in events))

    path = bench.audit_path(log, NS, "distributedtrainingjobs")
    assert set(path) == {"j0000", "j0001"}
    seen = path["j0000"]
    assert set(seen) == set(bench.MARKERS)
    start = seen["applied"]
    assert {m: round(t - start, 3) for m, t in seen.items()} == {
        "applied": 0.0, "first child": 0.1, "workers created": 0.2, "workers running": 0.3,
        "launcher job": 0.4, "launcher bound": 0.5, "launcher running": 0.6}

    latencies, steps = bench.audit_latencies(log, NS, "distributedtrainingjobs")
    assert {job: round(s, 3) for job, s in latencies.items()} == {"j0000": 0.6, "j0001": 0.6}
    assert steps == {"applied -> first child": 0.1, "first child -> workers created": 0.1,
                     "workers created -> workers running": 0.1, "workers running -> launcher job": 0.1,
                     "launcher job -> launcher bound": 0.1, "launcher bound -> launcher running": 0.1}


def test_a_job_whose_launcher_never_ran_has_no_latency(bench, tmp_path):
    log = tmp_path / "audit.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in job_events("j0000", 1.0)[:5]))
    latencies, steps = bench.audit_latencies(log, NS, "distributedtrainingjobs")
    assert latencies == {} and steps == {}
