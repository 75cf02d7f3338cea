"""(d) A DataStage copies an image set from Blob Storage (Azurite, through the real Azure SDK) into
a volume, and a job's real pods train on what they read from it.

The volume is NOT NFS: this kernel has no NFS client, so no node here can mount one. The test
uses `destination.volumeClaim` (an existing ReadWriteMany claim, as Azure Files gives on AKS)
backed by a hostPath PersistentVolume, which both real nodes reach because they share this
machine's filesystem. The provisioned NFS server serving real bytes to pods (through a user-space
NFS client) is tests/e2e/test_nfs_ganesha.py; the NFS rendering (PV, inline nfs volume) stays
covered by tests/cluster/test_datastage.py on KWOK nodes.
"""

from __future__ import annotations

import io
import os

import pytest
from PIL import Image

from tests.e2e.test_real_pods import digests, reduced, wait_phase
from tests.fixtures.waiting import wait_until

pytestmark = [pytest.mark.real, pytest.mark.azurite]

CLASSES, PER_CLASS = ("cat", "dog"), 8
COPY_UID = 10001  # the stager runs as the operator image's user


def upload_image_set(container) -> int:
    for label, name in enumerate(CLASSES):
        for i in range(PER_CLASS):
            buf = io.BytesIO()
            Image.new("RGB", (48, 40), (40 + 100 * label, 10 * i, 90)).save(buf, "JPEG", quality=90)
            container.upload_blob(f"train/{name}/{i:03d}.jpg", buf.getvalue())
    return len(CLASSES) * PER_CLASS


def test_staged_data_is_what_the_job_reads(real_cluster, real_namespace, real_operator, pod_azurite, tmp_path):
    ns = real_namespace
    container = pod_azurite.new_container()
    count = upload_image_set(container)
    sas = pod_azurite.container_sas(container.container_name, permission="rl")
    real_cluster.kubectl("create", "secret", "generic", "reader", "-n", ns, f"--from-literal=sas={sas}")

    # What an admin provides on AKS (an Azure Files share); here a hostPath PV both nodes reach.
    share = tmp_path / "share"
    share.mkdir()
    os.chown(share, COPY_UID, COPY_UID)
    real_cluster.shared_claim(ns, "shared", share)
    real_cluster.apply({
        "apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": {"name": "pets"},
        "spec": {"source": {"blob": {"accountURL": pod_azurite.http_url, "container": container.container_name,
                                     "prefix": "train/", "auth": {"sasSecretRef": {"name": "reader", "key": "sas"}}}},
                 "destination": {"volumeClaim": {"claimName": "shared"}}}}, ns)
    manifest = reduced("imagenet-pytorch-horovod.yaml", "pets-train", output=None,
                       data={"dataStageRef": {"name": "pets"}, "mountPath": "/data"})
    real_cluster.apply(manifest, ns)

    stage = wait_until(lambda: (s := real_cluster.get("datastage", "pets", "-n", ns).get("status", {}))
                       .get("phase") == "Ready" and s, timeout=300, interval=1, what="DataStage pets Ready")
    assert stage["claimName"] == "shared"
    real_cluster.assert_ran_on_real_nodes(ns, "trainop.io/datastage=pets")
    assert sorted(p.relative_to(share).as_posix() for p in share.rglob("*.jpg")) == sorted(
        f"train/{c}/{i:03d}.jpg" for c in CLASSES for i in range(PER_CLASS))

    wait_phase(real_cluster, ns, "pets-train", "Succeeded")
    log = real_cluster.logs(ns, "job/pets-train-launcher", "-c", "launcher")
    for rank in (0, 1):
        assert f"rank {rank}/2 reads {count // 2} of {count} images ({len(CLASSES)} classes) in /data" in log, log[-3000:]
    ranks = digests(log)
    assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 1
