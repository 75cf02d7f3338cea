"""`ClusterHandle.get` answers the forms the tests use in-process (tests/fixtures/kubeget.py):
what it returns is what `kubectl get -o json` prints, on the real API server."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.fixtures.kubeget import InProcessGet, parse

pytestmark = pytest.mark.cluster


def test_the_forms_it_parses_and_those_it_leaves_to_kubectl():
    assert parse(("pods", "-n", "x", "-l", "a=b")) == ("pods", None, {"namespace": "x", "labelSelector": "a=b"})
    assert parse(("job/l", "--namespace=x")) == ("job", "l", {"namespace": "x"})
    assert parse(("dtj", "d", "-n", "x")) == ("dtj", "d", {"namespace": "x"})
    assert parse(("events", "--field-selector", "reason=X")) == ("events", None, {"fieldSelector": "reason=X"})
    for kubectls in [("pods", "-A"), ("pods,jobs",), ("pods", "a", "b"), ("pods", "-n"), ("pod", "a", "-l", "x=y"),
                     ("pods", "-o", "name")]:
        assert parse(kubectls) is None, kubectls


def test_it_returns_what_kubectl_prints(cluster, namespace):
    cluster.apply([
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "labels": {"k": "1"}}, "data": {"x": "1"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "b"}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": {"suspend": True, "template": {
            "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}},
        {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob", "metadata": {"name": "d"},
         "spec": yaml.safe_load("{framework: pytorch, workers: 1, gpusPerWorker: 1, data: {synthetic: true}}")},
    ], namespace)
    ours = InProcessGet(cluster.kubeconfig)
    ns = ("-n", namespace)
    for args in [("configmaps", *ns), ("cm", "a", *ns), ("configmap/b", *ns), ("configmaps", *ns, "-l", "k=1"),
                 ("configmaps", *ns, "--field-selector", "metadata.name=b"), ("jobs.batch", *ns), ("job/j", *ns),
                 ("dtj", *ns), ("distributedtrainingjob", "d", *ns), ("DistributedTrainingJob.trainop.io", *ns),
                 ("nodes",), ("node", cluster.get("nodes")["items"][0]["metadata"]["name"]),
                 ("priorityclasses",), ("crd", "distributedtrainingjobs.trainop.io")]:
        kubectl = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
        got = ours(args)
        assert got is not None, args
        if "items" in kubectl:
            assert [(i["apiVersion"], i["kind"], i["metadata"]["name"]) for i in got["items"]] == \
                   [(i["apiVersion"], i["kind"], i["metadata"]["name"]) for i in kubectl["items"]], args
            assert got["kind"] == kubectl["kind"] == "List"
            assert got["items"] == kubectl["items"], args
        else:
            assert got == kubectl, args
    with pytest.raises(RuntimeError, match=r"kubectl get cm nope .*failed: Error from server \(NotFound\)"):
        ours(("cm", "nope", *ns))
    assert ours(("no-such-kind",)) is None  # kubectl then says what is wrong with the name


def test_no_api_server_is_a_runtime_error_as_kubectls_failure_is(cluster, tmp_path):
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = "https://127.0.0.1:1"  # nothing listens there
    dead = tmp_path / "kubeconfig"
    dead.write_text(yaml.safe_dump(config))
    with pytest.raises(RuntimeError, match=r"kubectl get .* failed: .*Connection refused"):
        InProcessGet(dead)(("cm", "a", "-n", "x"))
