"""Ranks that hang (issue 24): a collective that never completes, a deadlocked data loader. The
gang's pods stay Running and nothing fails, so no peer notices. trainop reads every rank's
progress through rank 0's reports (the shipper's progress ConfigMap): with
runPolicy.stallTimeoutSeconds, a step that has not advanced for that long, by the operator's
own clock, sets the condition Stalled and restarts the gang from the last checkpoint as a
failure of class Stall (failurePolicy rules can match it; counted against backoffLimit unless
one says otherwise). The ranks dumped their Python stacks into their logs before that (the
trainer's watchdog, trainop_trainer/stall.py, armed with the same seconds).

The clock starts once the step has moved within the attempt: the ConfigMap still holds the
previous attempt's last report while the new one loads data and compiles, and a job that never
reported (its own program, no metrics file) is never judged. The report is written by job
code; all it can do here is restart its own job, or keep it from being restarted.
"""

from __future__ import annotations

import datetime as dt

from trainop import conditions
from trainop.actions import Outcome
from trainop.jobsync.failures import Failure, _gang_failed
from trainop.jobsync.model import _Plan, _Status, _ts
from trainop.render import dtj as render
from trainop.render import logship
from trainop.spec import Job

CAUSE = "Stall"


def judge(plan: _Plan, job: Job, st: _Status, attempt: int) -> Outcome | None:
    """status.stall kept up to date from the latest report; a restart once the step has not
    moved for stallTimeoutSeconds (and a wake-up at that moment until then)."""
    timeout = job.run_policy.stall_timeout_seconds
    metrics = logship.progress_metrics(plan.snap.progress) or {}
    step = metrics.get("step")
    if not timeout or not isinstance(step, int) or metrics.get("final") is True:
        st.data.pop("stall", None)
        return None
    seen = st.data.get("stall") or {}
    if seen.get("attempt") != attempt:  # a new attempt: the report may be the last one's
        st.data["stall"] = {"attempt": attempt, "step": step}
        return None
    if seen.get("step") != step:
        st.data["stall"] = {"attempt": attempt, "step": step, "since": _ts(plan.now)}
        if st.is_true("Stalled"):
            st.cond("Stalled", False, "Progressing", f"step {step} reached")
        seen = st.data["stall"]
    if "since" not in seen:
        return None
    deadline = conditions.parse_time(seen["since"]) + dt.timedelta(seconds=timeout)
    left = (deadline - plan.now).total_seconds()
    if left > 0:
        plan.out.requeue_after = min(left, plan.out.requeue_after or left)
        return None
    text = (f"no step past {step} since {seen['since']} (runPolicy.stallTimeoutSeconds={timeout}); "
            f"every rank's Python stacks are in the logs")
    st.cond("Stalled", True, "NoProgress", text)
    st.data.pop("stall", None)
    failure = Failure(pod=render.worker_name(job, 0), container=render.WORKER, exit_code=None,
                      reason=CAUSE, detail=text)
    return _gang_failed(plan, job, st, failure)
