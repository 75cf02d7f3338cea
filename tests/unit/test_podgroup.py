"""Gang placement at the scheduler: the PodGroup (render/podgroup.py, podgroup.render_for) and
what the pods carry, for scheduler-plugins and Volcano."""

import asyncio
import dataclasses

import pytest

from trainop import config, podgroup
from trainop.handlers import indexes
from trainop.render import dtj
from trainop.render import podgroup as render
from trainop.spec import SpecError, parse

CFG = config.load(None)


def job(kind=None, cfg=CFG, **spec):
    j = parse({"metadata": {"name": "j1", "namespace": "team-a"}, "spec": spec}, cfg)
    return podgroup.bind(j, kind, cfg)


def test_no_gang_scheduler_changes_nothing():
    plain = job(workers=2, gpusPerWorker=4)
    assert podgroup.render_for(plain) is None
    assert "schedulerName" not in dtj.render_worker(plain, 0, 0)["spec"]


def test_scheduler_plugins_pod_group_and_pods():
    j = job("scheduler-plugins", workers=2, gpusPerWorker=4,
            resources={"requests": {"cpu": "8", "memory": "64Gi"}},
            runPolicy={"schedulingPolicy": {"scheduleTimeoutSeconds": 120}})
    assert podgroup.render_for(j) == {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
        "metadata": {"name": "j1", "namespace": "team-a", "labels": {"trainop.io/job-name": "j1"}},
        # the launcher joins later (after every worker is Ready): never part of the quorum
        "spec": {"minMember": 2, "scheduleTimeoutSeconds": 120,
                 "minResources": {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "8"}}}
    worker = dtj.render_worker(j, 1, 0)
    launcher = dtj.render_launcher(j, 0)["spec"]["template"]
    for pod in (worker, launcher):
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "j1"


def test_volcano_pod_group_takes_queue_and_priority():
    cfg = config.from_dict({"gangScheduling": {"scheduler": "volcano", "schedulerName": "vc",
                                               "allowedQueues": ["research"]}})
    j = job("volcano", cfg, workers=3, gpusPerWorker=1, launcher="torchrun",
            runPolicy={"schedulingPolicy": {"minAvailable": 2, "queue": "research",
                                            "priorityClass": "high",
                                            "minResources": {"nvidia.com/gpu": 2}}})
    assert j.priority_class_name == "high"  # judged by priority.py like spec.priorityClassName
    j = dataclasses.replace(j, pod_priority_class="high")  # what priority.bind sets once judged
    pg = podgroup.render_for(j)
    assert pg["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert pg["spec"] == {"minMember": 2, "queue": "research", "priorityClassName": "high",
                          "minResources": {"nvidia.com/gpu": "2"}}
    pod = dtj.render_worker(j, 0, 0)
    assert pod["spec"]["schedulerName"] == "vc"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "j1"


def test_the_groups_keys_are_the_operators():
    for key in render.PLUGINS_LABEL, render.VOLCANO_ANNOTATION:
        where = "labels" if key == render.PLUGINS_LABEL else "annotations"
        with pytest.raises(SpecError) as err:
            job(podTemplate={"worker": {"metadata": {where: {key: "other"}}}})
        assert err.value.field == f"spec.podTemplate.worker.metadata.{where}[{key}]"


def test_bad_gang_scheduling_config_names_the_key():
    with pytest.raises(config.ConfigError, match="gangScheduling.scheduler"):
        config.from_dict({"gangScheduling": {"scheduler": "kube-batch"}})


def test_the_pod_groups_class_and_queue_are_judged_like_the_pods_class():
    """Issue 22, M1: the PodGroup's priorityClassName is the job's one class (which priority.py
    caps at limits.maxPriority), never a second, unjudged name; a Volcano queue (cluster-wide)
    only one the admin listed."""
    cfg = config.from_dict({"gangScheduling": {"scheduler": "volcano"}})
    with pytest.raises(SpecError) as err:
        job("volcano", cfg, priorityClassName="low",
            runPolicy={"schedulingPolicy": {"priorityClass": "system-cluster-critical"}})
    assert err.value.field == "spec.runPolicy.schedulingPolicy.priorityClass"
    with pytest.raises(SpecError) as err:
        job("volcano", cfg, runPolicy={"schedulingPolicy": {"queue": "other-teams-queue"}})
    assert err.value.field == "spec.runPolicy.schedulingPolicy.queue"
    assert "gangScheduling.allowedQueues" in str(err.value)
    # unbound (the class not judged yet, or a WorkloadPriorityClass): the group names none
    j = job("volcano", cfg, runPolicy={"schedulingPolicy": {"priorityClass": "x"}})
    assert "priorityClassName" not in podgroup.render_for(j)["spec"]
    with pytest.raises(config.ConfigError, match="gangScheduling.allowedQueues"):
        config.from_dict({"gangScheduling": {"allowedQueues": "all"}})


def test_the_two_schedulers_pod_groups_have_keys_of_their_own_in_the_index():
    """Both APIs call the kind PodGroup: the one index of a job's Workload and PodGroups keys each by its API
    group too, in the order the controller looks in (POD_GROUPS)."""
    keys = []
    for kind in (render.PLUGINS, render.VOLCANO):
        body = {"apiVersion": render.API_VERSION[kind], "kind": "PodGroup", "metadata": {
            "name": "j1", "namespace": "team-a", "labels": {indexes.LABEL_JOB: "j1"}}}
        keys += asyncio.run(indexes.dtj_admission(body=body, namespace="team-a"))
    assert keys == [("team-a", "j1", kind) for kind in indexes.POD_GROUPS]
