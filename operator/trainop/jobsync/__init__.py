"""Every decision of one DistributedTrainingJob reconcile (`decide`), split by policy as JobSet
splits its controller: `decide.py` (the order of the steps, the job's end), `gang.py` (children,
workers, launcher, waiting for nodes), `failures.py` (failure classes, failurePolicy, restarts),
`queueing.py` (native queue and Kueue: admission, eviction, the Workload's lifecycle,
suspension), `fabric.py` (preflight and InfiniBand), `data.py` (the DataStage's claim,
checkpoints, progress), `model.py` (the snapshot, the status being built, the plan of actions).

    outcome = jobsync.decide(JobSnapshot(body, pods=..., launcher=...), cfg, now)
"""

from trainop.admission import Decision
from trainop.jobsync.decide import decide
from trainop.jobsync.failures import (
    DISRUPTIONS,
    FAIL_JOB,
    HISTORY,
    RESTART,
    RESTART_UNCOUNTED,
    Failure,
    action_for,
    attempt,
    node_lost,
    pod_failure,
    restart_counts,
    restart_gang,
)
from trainop.jobsync.model import TERMINAL, JobSnapshot

__all__ = ["DISRUPTIONS", "FAIL_JOB", "HISTORY", "RESTART", "RESTART_UNCOUNTED", "TERMINAL",
           "Decision", "Failure", "JobSnapshot", "action_for", "attempt", "decide",
           "node_lost", "pod_failure", "restart_counts", "restart_gang"]
