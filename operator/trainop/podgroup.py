"""Which gang scheduler places a job's pods: the one the operator's configuration names
(`gangScheduling.scheduler`: scheduler-plugins or volcano), when the cluster serves its PodGroup
API. Without the API nothing changes: no PodGroup, the pods keep the default scheduler (a
schedulerName that nothing serves would leave them Pending forever).

    kind = podgroup.scheduler(cfg)         # "scheduler-plugins" | "volcano" | None (cached)
    job = podgroup.bind(job, kind, cfg)    # the pods get schedulerName and the group's label
    obj = podgroup.render_for(job)         # the PodGroup manifest (render/podgroup.py), or None
"""

from __future__ import annotations

import dataclasses
import logging

from trainop import admission, kube
from trainop.config import Config
from trainop.memo import Memos
from trainop.render import dtj
from trainop.render import podgroup as render
from trainop.spec import Job

log = logging.getLogger(__name__)
DEFAULT_SCHEDULER_NAMES = {render.PLUGINS: "scheduler-plugins-scheduler", render.VOLCANO: "volcano"}

_told: set[str] = set()  # the kinds whose missing API was logged once


def served(kind: str) -> bool:
    """Is `kind`'s PodGroup API served? (kube.served: cached)"""
    found = kube.served(render.API_VERSION[kind])
    if not found and kind not in _told:
        _told.add(kind)
        log.info("gangScheduling.scheduler is %s but the cluster does not serve %s: pods use "
                 "the default scheduler, without a PodGroup", kind, render.API_VERSION[kind])
    return found


def scheduler(cfg: Config) -> str | None:
    kind = cfg.gang_scheduler
    return kind if kind and served(kind) else None


def bind(job: Job, kind: str | None, cfg: Config, memo: Memos | None = None) -> Job:
    """`job` whose pods `kind` places (None: unchanged); one object per (Job, kind) with the
    controller's `memo`, as priority.bind keeps them."""
    if kind is None:
        return job
    make = lambda: dataclasses.replace(job, gang_scheduler=kind, gang_scheduler_name=(  # noqa: E731
        cfg.gang_scheduler_name or DEFAULT_SCHEDULER_NAMES[kind]))
    return make() if memo is None else memo.bound.get(job, ("gang", kind), make)


def render_for(job: Job) -> dict | None:
    """The bound job's PodGroup, its minResources from a rendered worker's requests."""
    if job.gang_scheduler is None:
        return None
    worker = dtj.render_worker(job, 0, 0)
    n = render.min_member(job)
    requests = {k: admission.show(v * n, k)
                for k, v in admission.pod_requests(worker["spec"]).items()}
    return render.render(job, requests)
