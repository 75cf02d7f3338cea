"""(f) Pod Security: a namespace labelled `pod-security.kubernetes.io/enforce=restricted` admits
and runs every pod of a job (workers, launcher, log-shipping sidecar), non-root with all
capabilities dropped; which pods the profile refuses, and the field that makes it, is checked by
the API server's own Pod Security admission."""

from __future__ import annotations

import pytest
import yaml

from tests.e2e.test_real_pods import EXAMPLES, digests, reduced, wait_phase, with_blob_output
from trainop import config, spec
from trainop.render import datastage as render_datastage
from trainop.render import dtj as render_dtj

pytestmark = [pytest.mark.real, pytest.mark.azurite]



def test_job_pods_run_under_the_restricted_profile(real_cluster, restricted_namespace, restricted_operator,
                                                    pod_azurite):
    ns = restricted_namespace
    manifest = reduced("pytorch-horovod-synthetic.yaml", "strict")
    # the pods stay after Succeeded for the checks below (the default, Running, deletes the
    # workers at the end: a listing after Succeeded once found only the launcher)
    manifest["spec"].setdefault("runPolicy", {})["cleanPodPolicy"] = "None"
    with_blob_output(manifest, real_cluster, ns, pod_azurite)
    real_cluster.apply(manifest, ns)
    wait_phase(real_cluster, ns, "strict", "Succeeded")
    pods = real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/job-name=strict")
    assert {p["metadata"]["labels"]["trainop.io/role"] for p in pods} == {"launcher", "worker"}
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
            # the one capability restricted allows, for a stock MPI image's setcap sshd
            added = ["NET_BIND_SERVICE"] if container["name"] == "worker" else None
            assert container["securityContext"]["capabilities"].get("add") == added, container["name"]
    ranks = digests(real_cluster.logs(ns, "job/strict-launcher", "-c", "launcher"))
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 1


def test_which_pods_the_restricted_profile_admits(real_cluster, restricted_namespace):
    """The API server's own Pod Security admission (server-side dry run) admits an InfiniBand
    job's worker (no added capability: RDMA's memlock comes from the runtime, docs/security.md)
    and refuses only the DataStage copy Job of an NFS destination, naming its inline nfs volume."""
    ns = restricted_namespace
    manifest = yaml.safe_load((EXAMPLES / "infiniband-pytorch-horovod.yaml").read_text())
    manifest["metadata"] = {"name": "ib", "namespace": ns}
    worker = render_dtj.render_worker(spec.parse(manifest, config.load()), 0, 0)
    admitted = real_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(worker), check=False)
    assert admitted.returncode == 0, admitted.stderr

    stage = spec.parse_stage({
        "apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": {"name": "nfs", "namespace": ns},
        "spec": {"source": {"blob": {"accountURL": "https://acct.blob.core.windows.net", "container": "c",
                                     "auth": {"sasSecretRef": {"name": "s", "key": "sas"}}}},
                 "destination": {"nfs": {"server": "10.245.255.1", "path": "/export"}}}})
    job = render_datastage.copy_job(stage, "10.245.255.1", config.load())
    # The `default` ServiceAccount: admission looks the pod's account up before Pod Security,
    # and the stager's own is made only by a real DataStage.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "copy", "namespace": ns},
           "spec": dict(job["spec"]["template"]["spec"], serviceAccountName="default")}
    refused = real_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted:latest": restricted volume types (volume "share" uses restricted ' \
           'volume type "nfs")' in refused.stderr, refused.stderr
