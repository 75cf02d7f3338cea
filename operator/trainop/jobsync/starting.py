"""Pods that can never start (issue 24): an image that cannot be pulled, or an env var from a
Secret or ConfigMap that does not exist, leaves a pod Pending with a container `waiting` for a
reason the kubelet retries forever (kubeflow/trainer#2001: jobs stuck for days). The condition
PodsNotStarting names the first such pod, its reason and the kubelet's message within seconds;
after runPolicy.startTimeoutSeconds the job fails with that reason, its pods deleted (quota
freed), and no restart is counted: another attempt would meet the same image or Secret.
"""

from __future__ import annotations

import datetime as dt

from trainop import conditions
from trainop.actions import Outcome
from trainop.jobsync.model import _finish, _Plan, _Status, _stop, _ts
from trainop.spec import Job

# The kubelet's waiting reasons that no wait will cure; ContainerCreating and PodInitializing
# are the normal road to Running and are not judged here.
NOT_STARTING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                "CreateContainerConfigError", "CreateContainerError")
# One cause, two names: the kubelet alternates them between pull attempts.
SAME_CAUSE = {"ImagePullBackOff": "ErrImagePull"}
CONDITION = "PodsNotStarting"


def stuck(pods: list[dict]) -> list[tuple[str, str, str, str]]:
    """(pod, container, reason, kubelet message) of every container that cannot start."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in NOT_STARTING:
                out.append((pod["metadata"]["name"], cs.get("name", ""), waiting["reason"],
                            waiting.get("message") or ""))
    return sorted(out)


def judge(plan: _Plan, job: Job, st: _Status, pods: list[dict]) -> Outcome | None:
    """The condition set or cleared; the job failed once startTimeoutSeconds has passed since
    it was first set (its own lastTransitionTime: a restarted operator keeps the deadline)."""
    found = stuck([p for p in pods if not p["metadata"].get("deletionTimestamp")])
    was = conditions.get_condition(st.data.get("conditions"), CONDITION) if st.is_true(CONDITION) else None
    if not found:
        if was:
            st.cond(CONDITION, False, "PodsStarted", "every pod of the gang started")
        return None
    pod, container, reason, said = found[0]
    cause = SAME_CAUSE.get(reason, reason)
    head = f"pod {pod}: container {container}: {cause}"
    others = f" (and {len(found) - 1} more container{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
    # The kubelet's message changes with each retry (ErrImagePull's error, then "Back-off
    # pulling image"): the first one is kept, so the condition (and its one INFO line) stays.
    text = was["message"] if was and was.get("message", "").startswith(head + ":") \
        else f"{head}: {said[:512]}{others}"
    timeout = job.run_policy.start_timeout_seconds
    since = conditions.parse_time(was["lastTransitionTime"]) if was and was.get("lastTransitionTime") \
        else plan.now
    if timeout:
        deadline = since + dt.timedelta(seconds=timeout)
        left = (deadline - plan.now).total_seconds()
        if left <= 0:
            _finish(st, "Failed", cause, f"{text}; the pod did not start within "
                    f"runPolicy.startTimeoutSeconds={timeout}: fix the image or create the "
                    f"Secret or ConfigMap, then create the job again", plan.now)
            st.cond(CONDITION, False, "StartTimeout", "the job failed")
            _stop(plan, "All")
            plan.out.requeue_after = None
            return plan.out
        plan.out.requeue_after = min(left, plan.out.requeue_after or left)
        text_with_deadline = f"; the job fails at {_ts(deadline)} unless it starts"
        if not text.endswith(text_with_deadline):
            text = text.split("; the job fails at ")[0] + text_with_deadline
    st.cond(CONDITION, True, cause, text)
    plan.out.waiting = text
    return None
