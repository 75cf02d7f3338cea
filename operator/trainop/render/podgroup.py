"""Gang placement at the scheduler: the PodGroup of a job and what its pods carry, for the
scheduler-plugins coscheduling plugin or Volcano, as the MPI Operator renders them
(`runPolicy.schedulingPolicy`). Pure: a parsed spec.Job in, dicts out.

    pg = podgroup.render(job, requests)     # the PodGroup, or None (no gang scheduler bound)
    podgroup.decorate(job, metadata, spec)  # schedulerName and the group's label/annotation

A job gets a PodGroup only when the operator's configuration names a gang scheduler
(`gangScheduling.scheduler`) and the cluster serves that scheduler's PodGroup API (the
controller binds it: `dataclasses.replace(job, gang_scheduler=...)`, see trainop/podgroup.py).

minMember is the workers (schedulingPolicy.minAvailable overrides it): the launcher pod is
created only after every worker is Ready, so counting it would hold the workers back forever;
it carries the group's label too, and joins a group whose quorum is already met.
"""

from __future__ import annotations

from trainop.spec import Job

PLUGINS, VOLCANO = "scheduler-plugins", "volcano"
API_VERSION = {PLUGINS: "scheduling.x-k8s.io/v1alpha1", VOLCANO: "scheduling.volcano.sh/v1beta1"}
PLUGINS_LABEL = "scheduling.x-k8s.io/pod-group"       # scheduler-plugins' PodGroupLabel
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"   # Volcano's KubeGroupNameAnnotationKey


def name(job: Job) -> str:
    return job.name


def min_member(job: Job) -> int:
    return job.scheduling_policy.min_available or job.workers


def render(job: Job, gang_requests: dict[str, str]) -> dict | None:
    """The job's PodGroup; `gang_requests`: what minMember workers request together, its
    minResources unless schedulingPolicy.minResources says otherwise."""
    kind = job.gang_scheduler
    if kind is None:
        return None
    policy = job.scheduling_policy
    spec: dict = {"minMember": min_member(job)}
    resources = dict(policy.min_resources or gang_requests)
    if resources:
        spec["minResources"] = resources
    if kind == PLUGINS:
        spec["scheduleTimeoutSeconds"] = policy.schedule_timeout_seconds or 0
    else:  # Volcano: the queue and the priority the MPI Operator passes to it
        if policy.queue:  # one of gangScheduling.allowedQueues (spec.parse)
            spec["queue"] = policy.queue
        # The job's class as priority.py judged it (schedulingPolicy.priorityClass is another
        # name for it): never a class past limits.maxPriority, never one the pods lack.
        if job.pod_priority_class:
            spec["priorityClassName"] = job.pod_priority_class
    return {"apiVersion": API_VERSION[kind], "kind": "PodGroup",
            "metadata": {"name": name(job), "namespace": job.namespace,
                         "labels": {"trainop.io/job-name": job.name}},
            "spec": spec}


def decorate(job: Job, metadata: dict, pod_spec: dict) -> None:
    """A pod of the job joins its group: the gang scheduler places it."""
    if job.gang_scheduler is None:
        return
    pod_spec["schedulerName"] = job.gang_scheduler_name
    if job.gang_scheduler == PLUGINS:
        metadata.setdefault("labels", {})[PLUGINS_LABEL] = name(job)
    else:
        metadata.setdefault("annotations", {})[VOLCANO_ANNOTATION] = name(job)

