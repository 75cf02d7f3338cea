"""The fabric check's result and what the operator concludes from it. Pure: pods in (as the
watch cache holds them), a Report and a Verdict out; jobsync.decide acts on the Verdict.

    report = preflight.report(worker0_pod, workers=job.workers)   # None until it has run
    verdict = preflight.judge(report, job.preflight.min_busbw, pods_by_index)

Where the result comes from: worker 0's init container `preflight` (render/fabric.py) writes
one JSON object as its termination message, which the kubelet puts into the pod's status
(at most 4096 bytes). No pod can write the job's status; the message is job-side input, so it is
checked like the progress ConfigMap: known keys, numbers, worker indexes within the gang. The
worst a forged report can do is fail its own job's check, or name one of its own workers: the
node to taint is looked up here from the pod the operator created for that worker
(`spec.nodeName`), never taken from the report, so a job can taint only a node its own pod
runs on, and only where the admin enabled tainting (docs/security.md), and never more than
`preflight.maxTaintedNodes` nodes in the whole cluster: `taint_refused` counts the nodes that
already carry the taint (the cluster's own state, not a job's), so deleting and re-creating a
job, or many jobs at once, cannot taint more.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from trainop.render import fabric

MAX_MESSAGE = 4096
CONTAINER = fabric.PREFLIGHT
# What the operator adds to a node the check found slow (only where the admin enabled it).
TAINT = {"key": fabric.UNHEALTHY_TAINT, "value": "preflight", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Pair:
    workers: tuple[int, int]
    busbw: float


@dataclass(frozen=True)
class Report:
    busbw: float
    passed: bool
    size_bytes: int
    world_size: int
    backend: str
    transport: str
    pairs: tuple[Pair, ...] = ()


@dataclass(frozen=True)
class Verdict:
    passed: bool
    suspect: int | None      # the worker slow in every pair it was in (None: none stands out)
    node: str | None         # that worker's node, from its pod
    message: str


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def parse(message: str | None, workers: int) -> Report | None:
    """The preflight's termination message as a Report; None when it is not a valid one."""
    if not message or len(message) > MAX_MESSAGE:
        return None
    try:
        obj = json.loads(message)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    busbw, size, world = (_number(obj.get(k)) for k in ("busBandwidthGBps", "sizeBytes", "worldSize"))
    if busbw is None or size is None or world is None or not isinstance(obj.get("passed"), bool):
        return None
    pairs = []
    for item in obj.get("pairs") or []:
        ws = item.get("workers") if isinstance(item, dict) else None
        bw = _number(item.get("busBandwidthGBps")) if isinstance(item, dict) else None
        if not (isinstance(ws, list) and len(ws) == 2 and bw is not None and
                all(isinstance(w, int) and not isinstance(w, bool) and 0 <= w < workers for w in ws)
                and ws[0] != ws[1]):
            return None
        pairs.append(Pair((ws[0], ws[1]), bw))
    transport = obj.get("transport") if obj.get("transport") in ("IB", "Socket") else "unknown"
    backend = obj.get("backend") if obj.get("backend") in ("nccl", "gloo") else "unknown"
    return Report(busbw=busbw, passed=obj["passed"], size_bytes=int(size), world_size=int(world),
                  backend=backend, transport=transport, pairs=tuple(pairs))


def _init_status(pod: dict | None) -> dict | None:
    for cs in ((pod or {}).get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") == fabric.PREFLIGHT:
            return cs
    return None


def terminated(pod: dict | None) -> dict | None:
    """The preflight container's terminated state in `pod` (None while it runs or never ran)."""
    cs = _init_status(pod)
    if cs is None:
        return None
    return (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")


def report(worker0: dict | None, workers: int) -> Report | None:
    """What worker 0's preflight reported (its ranks' results agree; worker 0 hosts rank 0)."""
    term = terminated(worker0)
    return parse((term or {}).get("message"), workers) if term else None


def failed(pod: dict) -> bool:
    """The pod's preflight container ended with a non-zero exit code."""
    term = terminated(pod)
    return bool(term and term.get("exitCode"))


def suspect(pairs: tuple[Pair, ...], threshold: float) -> int | None:
    """The one worker below `threshold` in every pair it was in, while some pair passed (else
    the fabric or the threshold is the problem, not one node)."""
    if not pairs or all(p.busbw < threshold for p in pairs):
        return None
    workers = {w for p in pairs for w in p.workers}
    slow = [w for w in sorted(workers)
            if all(p.busbw < threshold for p in pairs if w in p.workers)]
    return slow[0] if len(slow) == 1 else None


def judge(rep: Report, threshold: float, pods_by_index: dict[int, dict]) -> Verdict:
    """Pass or fail, and on failure the worker to blame and the node its pod ran on."""
    if rep.passed and rep.busbw >= threshold:
        return Verdict(True, None, None,
                       f"all-reduce bus bandwidth {rep.busbw:g} GB/s over {rep.world_size} ranks "
                       f"({rep.backend}, {rep.transport}) >= {threshold:g} GB/s")
    below = (f"all-reduce bus bandwidth {rep.busbw:g} GB/s over {rep.world_size} ranks is below "
             f"spec.preflight.minBusBandwidthGBps={threshold:g}")
    worker = suspect(rep.pairs, threshold)
    if worker is None:
        return Verdict(False, None, None, f"{below}; no single worker was slow in every pair "
                                          f"({_pairs_text(rep.pairs) or 'no pairwise test'})")
    node = ((pods_by_index.get(worker) or {}).get("spec") or {}).get("nodeName")
    return Verdict(False, worker, node, f"{below}; worker {worker} (node {node or 'unknown'}) "
                                        f"was slow in every pair: {_pairs_text(rep.pairs)}")


def carrying(nodes: list[dict], key: str) -> list[str]:
    """The names of the nodes with a taint of `key`."""
    return [n["metadata"]["name"] for n in nodes
            if any(t.get("key") == key for t in (n.get("spec") or {}).get("taints") or [])]


def taint_refused(tainted: list[str] | tuple[str, ...], key: str, limit: int) -> str | None:
    """Why one more node may not get the taint `key` (None: it may): `tainted`, the nodes
    that carry it, are `limit` or more."""
    tainted = sorted(tainted)
    if len(tainted) < limit:
        return None
    return (f"{len(tainted)} node(s) already carry {key} ({', '.join(tainted[:10])}), the cluster's cap "
            f"preflight.maxTaintedNodes={limit}; an admin must look at them and remove the taint")


def _pairs_text(pairs: tuple[Pair, ...]) -> str:
    return ", ".join(f"{a}-{b} {bw:g} GB/s" for (a, b), bw in ((p.workers, p.busbw) for p in pairs))


def status(rep: Report, verdict: Verdict, threshold: float, attempt: int,
           tainted: bool = False) -> dict:
    """`status.preflight`."""
    out = {"attempt": attempt, "passed": verdict.passed, "busBandwidthGBps": rep.busbw,
           "minBusBandwidthGBps": threshold, "sizeBytes": rep.size_bytes,
           "worldSize": rep.world_size, "backend": rep.backend, "transport": rep.transport,
           "message": verdict.message}
    if rep.pairs:
        out["pairs"] = [{"workers": list(p.workers), "busBandwidthGBps": p.busbw} for p in rep.pairs]
    if verdict.suspect is not None:
        out["suspectWorker"] = verdict.suspect
        if verdict.node:
            out["suspectNode"] = verdict.node
        out["tainted"] = tainted
    return out
