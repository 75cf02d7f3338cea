"""The fabric's verdict (preflight, InfiniBand): a slow worker's node tainted and the gang
restarted without counting it, the training's transport checked against what was asked.
"""

from __future__ import annotations

from trainop import conditions, preflight
from trainop.actions import Outcome, TaintNode
from trainop.jobsync.failures import Failure, _gang_failed, restart_counts, restart_gang
from trainop.jobsync.model import _finish, _Plan, _Status, _stop
from trainop.render import dtj as render
from trainop.render import logship
from trainop.spec import Job

# How long a failed preflight waits for worker 0's report before it counts as an ordinary failure.
REPORT_GRACE_SECONDS = 60


def _fabric(plan: _Plan, job: Job, st: _Status, workers: dict[int, dict], attempt: int,
            failures: list[Failure]) -> Outcome | None:
    """The preflight's report (render/fabric.py, preflight.py): status.preflight, the Transport
    condition, and on a failed check the uncounted restart after tainting the slow node. None:
    carry on."""
    rep = preflight.report(workers.get(0), job.workers)
    if rep is None:
        return _await_report(plan, workers, failures)
    threshold = job.preflight.min_busbw
    verdict = preflight.judge(rep, threshold, workers)
    stopped = _transport(plan, job, st, rep.transport, f"preflight of attempt {attempt}",
                         gloo=rep.backend == "gloo")
    if stopped is not None:
        return stopped
    # Uncounted only when the slow node is out of the next attempt's way, and at most once per
    # worker: a gang that keeps failing after that has a problem no taint fixes.
    # The cluster's cap (preflight.maxTaintedNodes) is counted from the nodes' own taints, so
    # that status says what happens (apply's TaintNode counts again, against a race).
    capped = None if verdict.node in plan.snap.tainted_nodes else preflight.taint_refused(
        plan.snap.tainted_nodes, preflight.TAINT["key"], job.fabric.max_tainted_nodes)
    uncounted = (not verdict.passed and verdict.node is not None
                 and job.fabric.taint_unhealthy_nodes and capped is None
                 and restart_counts(st.data)["unhealthyNodes"] < job.workers)
    if not verdict.passed and verdict.node is not None and not uncounted:
        why = "the operator's preflight.taintUnhealthyNodes is false" \
            if not job.fabric.taint_unhealthy_nodes else capped or \
            f"{job.workers} uncounted restarts were used"
        verdict = preflight.Verdict(False, verdict.suspect, verdict.node,
                                    f"{verdict.message}; node not tainted ({why})")
    st.data["preflight"] = preflight.status(rep, verdict, threshold, attempt, tainted=uncounted)
    if verdict.passed:
        return None
    if uncounted:
        plan.out.actions.append(TaintNode(verdict.node, preflight.TAINT,
                                          limit=job.fabric.max_tainted_nodes))
    pod0 = render.worker_name(job, 0)
    cause = next((f for f in failures if f.pod == pod0 and f.container == "preflight"), None)
    failure = Failure(pod0, "preflight", cause.exit_code if cause else None, "FabricCheckFailed",
                      cause.finished if cause else "", node=verdict.node or "",
                      cause="UnhealthyNode" if uncounted else "", detail=verdict.message)
    if uncounted:  # the node is out of the next attempt's way: the cluster's fault, not the job's
        return restart_gang(plan, job, st, failure, counted=False)
    return _gang_failed(plan, job, st, failure)


def _await_report(plan: _Plan, workers: dict[int, dict], failures: list[Failure]) -> Outcome | None:
    """Another worker's preflight ended first: every rank learns the verdict at the same
    collective, but the containers end moments apart (seen on real pods), and the verdict is in
    worker 0's. Judging now would take a slow node for an ordinary (counted) failure, so wait for
    worker 0's to end, its pod's update wakes the job, at most REPORT_GRACE_SECONDS after the
    first one. None: nothing to wait for (worker 0's ended without a report, or it is gone)."""
    first = next((f for f in failures if f.container == preflight.CONTAINER), None)
    worker0 = workers.get(0)
    if first is None or worker0 is None or worker0["metadata"].get("deletionTimestamp") \
            or preflight.terminated(worker0) is not None:
        return None
    try:
        waited = (plan.now - conditions.parse_time(first.finished)).total_seconds()
    except ValueError:
        return None
    left = REPORT_GRACE_SECONDS - waited
    if left <= 0:
        return None
    plan.out.requeue_after = min(plan.out.requeue_after or left, left)
    return plan.wait(f"pod {first.pod}'s preflight ended (exit code {first.exit_code}); waiting "
                     f"up to {left:.0f}s for worker 0's, which carries the verdict")


def _transport(plan: _Plan, job: Job, st: _Status, transport: str, source: str,
               gloo: bool = False) -> Outcome | None:
    """Condition Transport from the network NCCL chose (IB, Socket or unknown), as the
    preflight or the trainer reported it (`source` says which). Both are job-side input: what
    they can do is limited to this job, a Warning Event when an InfiniBand job runs on sockets,
    or, where the admin set infiniband.socketTransport: fail, failing it. None: carry on."""
    wanted = "IB" if job.infiniband else "Socket"
    if transport == "Socket" and job.infiniband:
        message = (f"NCCL chose sockets, not InfiniBand, on an InfiniBand job ({source}): check "
                   f"the RDMA device plugin, memlock and NCCL_IB_HCA on the nodes")
        if job.fabric.socket_transport == "fail":
            st.cond("Transport", False, "Socket", message)
            _finish(st, "Failed", "SocketTransport",
                    message + "; the operator's infiniband.socketTransport is fail", plan.now)
            _stop(plan, job.run_policy.clean_pod_policy)
            plan.out.requeue_after = None
            return plan.out
    else:
        message = f"Gloo uses TCP sockets ({source})" if gloo else f"NCCL uses {transport} ({source})"
    st.cond("Transport", transport in (wanted, "unknown"),
            transport if transport != "unknown" else "Unknown", message)
    return None


def _training_transport(plan: _Plan, job: Job, st: _Status) -> Outcome | None:
    """The network NCCL chose during training: the trainer's metrics key `transport`, from the
    log shipper's progress ConfigMap (checked by logship.progress_metrics; only NCCL runs report
    it, so a CPU job says nothing here). Read while the gang runs; it overrides the preflight's
    word, since it is what the training itself uses. The ConfigMap keeps the latest report of
    any attempt, so the message does not claim one."""
    transport = (logship.progress_metrics(plan.snap.progress) or {}).get("transport")
    if transport is None:
        return None
    return _transport(plan, job, st, transport, "the trainer's report")
