"""Issue 22 M7: one namespace must not be able to fill the shared operator's memory through its
watch caches. The attacks: jobs with specs as large as the API server takes, and: anyone who may create ConfigMaps labels a flood of them
trainop.io/job-name (the operator watches ConfigMaps by that label), with large data, some
with the exact name of a job's progress ConfigMap but not owned by it, some owned by a real job
(ownerReferences are not checked by the API server) under other names. The ConfigMaps are real
objects on the real API server, listed with the operator's own label selector, and each goes
through the operator's own cache of a job's children (handlers/caches.py); what it holds is
measured."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes import client as k8s

from tests.cluster.test_dtj import FAST, Api, manifest
from tests.fixtures.waiting import wait_until
from trainop.handlers import caches, indexes
from trainop.render import logship

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

FLOOD = 60
BIG = "x" * 200_000  # ~200 KB a ConfigMap: 12 MB in all


class Wakes:
    """What the cache calls on the controller: nothing is reconciled here."""

    def __init__(self) -> None:
        self.applier = self

    def seen(self, kind, body) -> None:
        pass

    def enqueue_job(self, namespace, name) -> None:
        pass


def indexed(cluster, namespace: str) -> tuple[int, dict]:
    """(bytes listed, what the index holds) for the namespace's labelled ConfigMaps."""
    items = cluster.get("configmaps", "-n", namespace, "-l", indexes.LABEL_JOB)["items"]
    cache = caches.ChildCache(Wakes())
    for body in items:
        cache.observe("ADDED", body)
    held = {key: list(store) for key, store in cache.ix["dtj_children"].items()}  # key -> values
    return sum(len(json.dumps(b)) for b in items), held


def test_a_flood_of_labelled_config_maps_does_not_grow_the_index(cluster, namespace):
    cluster.apply({"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
                   "metadata": {"name": "victim"}, "spec": {"workers": 1, "gpusPerWorker": 1}}, namespace)
    job = cluster.get("dtj", "victim", "-n", namespace)
    owner = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "name": "victim",
             "uid": job["metadata"]["uid"], "controller": True}

    core = k8s.CoreV1Api(cluster.api_client())

    def put(body: dict) -> None:  # not kubectl apply: its annotation would copy the data
        name = body["metadata"]["name"]
        if any(c.metadata.name == name for c in core.list_namespaced_config_map(namespace).items):
            core.replace_namespaced_config_map(name, namespace, body)
        else:
            core.create_namespaced_config_map(namespace, body)

    def cm(name: str, job_name: str, owned: bool, data: dict, role: str | None = None) -> dict:
        labels = {indexes.LABEL_JOB: job_name, **({"trainop.io/role": role} if role else {})}
        meta = {"name": name, "labels": labels, **({"ownerReferences": [owner]} if owned else {})}
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}

    # the job's real progress ConfigMap, as the shipper fills it, plus what a user adds to it
    metrics = json.dumps({"epoch": 1, "step": 10, "loss": 0.5})
    put(cm("victim-progress", "victim", True, {logship.PROGRESS_KEY: metrics, "history": BIG, "extra": BIG},
           role=logship.PROGRESS_ROLE))
    flood = [cm(f"flood-{i}", f"job-{i % 7}", False, {"blob": BIG}) for i in range(FLOOD // 3)]
    flood += [cm(f"owned-{i}", "victim", True, {"blob": BIG}, role=logship.PROGRESS_ROLE) for i in range(FLOOD // 3)]
    flood += [cm(f"job-{i}-progress", f"job-{i}", False, {logship.PROGRESS_KEY: BIG}, role=logship.PROGRESS_ROLE)
              for i in range(FLOOD // 3)]
    for body in flood:
        put(body)
    wait_until(lambda: len(cluster.get("configmaps", "-n", namespace, "-l", indexes.LABEL_JOB)["items"]) == FLOOD + 1,
               timeout=60, what="the flood listed")

    listed, held = indexed(cluster, namespace)
    size = len(json.dumps({repr(k): v for k, v in held.items()}))
    print(f"labelled ConfigMaps listed: {listed} bytes; held by the index: {size} bytes")
    assert listed > FLOOD * len(BIG)
    # only the job's own progress ConfigMap, with only what decide reads
    assert list(held) == [(namespace, "victim", "ConfigMap")]
    (progress,) = held[(namespace, "victim", "ConfigMap")]
    assert progress["metadata"]["name"] == "victim-progress" and progress["data"] == {logship.PROGRESS_KEY: metrics}
    assert size < 4096

    # the real key, but larger than any report the shipper writes: dropped, not held
    put(cm("victim-progress", "victim", True, {logship.PROGRESS_KEY: BIG}, role=logship.PROGRESS_ROLE))
    _, held = indexed(cluster, namespace)
    assert [v["data"] for v in held[(namespace, "victim", "ConfigMap")]] == [{}]



def test_jobs_as_large_as_the_api_server_takes_are_held_as_their_size_and_fail(cluster, namespace,
                                                                              operator_factory):
    """Each job carries ~1 MB of pod-template annotations (the API server takes it: the CRD
    bounds no field's size, and bounds per field would multiply to no bound at all). The
    operator's index keeps each as its size; each fails naming spec, with nothing created,
    while a normal job beside them runs."""
    operator_factory(config=FAST)
    api = Api(cluster, namespace)
    annotations = {f"k{i}": "x" * 100_000 for i in range(10)}
    custom = k8s.CustomObjectsApi(cluster.api_client())
    for i in range(3):  # the client, not kubectl apply: its annotation would double the body
        custom.create_namespaced_custom_object("trainop.io", "v1alpha1", namespace, "distributedtrainingjobs", manifest(
            f"huge-{i}", podTemplate={"worker": {"metadata": {"annotations": annotations}}}))
    cluster.apply(manifest("normal"), namespace)
    api.wait_running("normal")
    for i in range(3):
        status = api.wait_phase(f"huge-{i}", "Failed")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "InvalidSpec" and failed["message"].startswith("spec: is 977 KiB of JSON"), failed
        assert not any(api.children(f"huge-{i}").values())
    listed = cluster.get("dtj", "-n", namespace)["items"]
    held = {b["metadata"]["name"]: len(json.dumps(list(asyncio.run(indexes.dtj_bodies(
        body=b, name=b["metadata"]["name"], namespace=namespace)).values()))) for b in listed}
    print(f"jobs listed: {sum(len(json.dumps(b)) for b in listed)} bytes; held by the index: {held}")
    assert sum(len(json.dumps(b)) for b in listed) > 3_000_000
    assert all(size < 4096 for size in held.values()), held
