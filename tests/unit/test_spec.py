"""spec.parse / capacity_error / config: typed parsing with errors that name the field."""

import json

import pytest

from trainop import config, crds
from trainop.spec import SecurityContext, SpecError, capacity_error, parse

CFG = config.load(None)


def body(**spec):
    return {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
            "metadata": {"name": "j1", "namespace": "team-a"}, "spec": spec}


def test_defaults_come_from_the_crd():
    job = parse(body(), CFG)
    assert (job.framework, job.launcher, job.workers, job.gpus_per_worker) == ("pytorch", "mpi", 1, 0)
    assert job.slots_per_worker == 1 and job.mpi_implementation == "OpenMPI"
    assert job.synthetic and job.data_stage is None and job.data_mount_path == "/data"
    assert job.run_policy.backoff_limit == 3 and job.run_policy.clean_pod_policy == "Running"
    assert not job.run_policy.suspend and job.run_policy.active_deadline_seconds is None
    assert job.image == "trainop/trainer-pytorch:0.1.0"
    assert job.shm_size == "1Gi"
    assert job.placement.pool == "system"  # CPU job -> the configured CPU pool
    assert job.training.batch_size == 64 and job.training.precision == "fp32"


def test_gpu_and_infiniband_jobs_pick_their_default_pools():
    gpu = parse(body(gpusPerWorker=4, workers=2), CFG)
    assert gpu.placement.pool == "gpu" and gpu.slots_per_worker == 4 and gpu.total_gpus == 8
    assert gpu.placement.tolerations == ({"key": "nvidia.com/gpu", "operator": "Exists",
                                          "effect": "NoSchedule"},)
    ib = parse(body(gpusPerWorker=8, infiniband=True), CFG)
    assert ib.placement.pool == "ibgpu"
    assert ib.placement.node_selector == {"kubernetes.azure.com/agentpool": "ibgpu"}
    assert ib.placement.rdma_resource == "rdma/ib"


def test_pods_run_as_the_images_user_unless_the_spec_names_its_own():
    assert parse(body(), CFG).security == SecurityContext(10001, 10001, 10001)
    # an image with its own user, as Kubeflow MPI Operator's mpiuser examples: fsGroup follows
    # runAsGroup unless set
    mpiuser = parse(body(image="mpioperator/mpi-pi", securityContext={"runAsUser": 1000, "runAsGroup": 1000}), CFG)
    assert mpiuser.security == SecurityContext(run_as_user=1000, run_as_group=1000, fs_group=1000)
    assert parse(body(securityContext={"runAsUser": 1000, "runAsGroup": 0, "fsGroup": 2000}), CFG).security == \
        SecurityContext(1000, 0, 2000)


def test_root_only_where_the_admin_allows_privileged_pods():
    allowed = config.from_dict({"podTemplate": {"allow": {"privileged": True}}})
    root = parse(body(securityContext={"runAsUser": 0, "runAsGroup": 0}), allowed).security
    assert root == SecurityContext(0, 0, 0) and root.root
    assert not parse(body(), allowed).security.root


def test_explicit_selector_and_slots():
    job = parse(body(gpusPerWorker=2, slotsPerWorker=3,
                     nodePool={"nodeSelector": {"pool": "x"}, "tolerations": []}), CFG)
    assert job.placement.pool is None and job.placement.node_selector == {"pool": "x"}
    assert job.slots_per_worker == 3 and job.total_slots == 3


@pytest.mark.parametrize("spec,field,words", [
    ({"nodePool": {"name": "nope"}}, "spec.nodePool.name", "does not exist"),
    ({"nodePool": {"name": "gpu"}, "infiniband": True}, "spec.infiniband", "ibgpu"),
    ({"launcher": "torchrun", "framework": "tensorflow"}, "spec.launcher", "launcher: mpi"),
    ({"workers": 0}, "spec.workers", "minimum"),
    ({"runPolicy": {"cleanPodPolicy": "Sometimes"}}, "spec.runPolicy.cleanPodPolicy", "Running"),
    ({"securityContext": {"runAsUser": -1}}, "spec.securityContext.runAsUser", "minimum"),
    ({"securityContext": {"runAsUser": 0}}, "spec.securityContext.runAsUser",
     "0 (root) needs the cluster admin's podTemplate.allow.privileged"),
    ({"securityContext": {"runAsGroup": -1}}, "spec.securityContext.runAsGroup", "minimum"),
    # GPUs and RDMA devices only through gpusPerWorker / infiniband, where admission counts them
    ({"gpusPerWorker": 0, "resources": {"limits": {"nvidia.com/gpu": 8}}},
     "spec.resources.limits", "'nvidia.com/gpu' cannot be set here"),
    ({"resources": {"requests": {"cpu": "4", "rdma/ib": 1}}}, "spec.resources.requests",
     "spec.infiniband"),
])
def test_bad_input_names_the_field(spec, field, words):
    with pytest.raises(SpecError) as err:
        parse(body(**spec), CFG)
    assert err.value.field == field
    assert words in str(err.value)
    assert str(err.value).startswith(field + ": ")


def test_gpu_limit_from_configuration():
    cfg = config.from_dict({"limits": {"maxGpusPerJob": 8}})
    parse(body(gpusPerWorker=4, workers=2), cfg)
    with pytest.raises(SpecError, match=r"spec.gpusPerWorker: the job needs 12 GPUs .*at most 8"):
        parse(body(gpusPerWorker=4, workers=3), cfg)


def node(pool, gpus=0, rdma=0):
    return {"metadata": {"name": f"{pool}-n", "labels": {"kubernetes.azure.com/agentpool": pool}},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "rdma/ib": str(rdma)}}}


def test_capacity_checks_against_nodes():
    nodes = [node("system"), node("gpu", 4), node("ibgpu", 8, 1)]
    assert capacity_error(parse(body(gpusPerWorker=4), CFG), nodes) is None
    err = capacity_error(parse(body(gpusPerWorker=6), CFG), nodes)
    assert err.field == "spec.gpusPerWorker" and "largest node of node pool 'gpu' has 4" in str(err)
    assert capacity_error(parse(body(gpusPerWorker=8, infiniband=True), CFG), nodes) is None
    err = capacity_error(parse(body(gpusPerWorker=1), CFG), [node("system")])
    assert err.field == "spec.nodePool.name" and "no node matches" in str(err)
    err = capacity_error(parse(body(gpusPerWorker=1, infiniband=True,
                                    nodePool={"nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"}}),
                               CFG), nodes)
    assert err.field == "spec.infiniband"


def test_crd_defaulting_and_validation_offline():
    obj = crds.default(body(runPolicy={"suspend": True}))
    assert obj["spec"]["runPolicy"] == {"suspend": True, "backoffLimit": 3, "cleanPodPolicy": "Running",
                                        "managedBy": "trainop.io/operator"}
    assert obj["spec"]["data"] == {"synthetic": True, "mountPath": "/data"}
    assert crds.validate(obj) == []
    assert crds.validate(crds.default(body(gpusPerWorker=17))) == \
        ["spec.gpusPerWorker: 17 is greater than the maximum of 16"]


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(config.ConfigError, match=r"^nodePools.gpu.nodeSelector: required"):
        config.from_dict({"nodePools": {"gpu": {"tolerations": []}}})
    with pytest.raises(config.ConfigError, match=r"^defaultNodePools.gpu: 'gpu' is not in nodePools"):
        config.from_dict({"nodePools": {"a": {"nodeSelector": {"x": "y"}}},
                          "defaultNodePools": {"cpu": "a", "infiniband": "a"}})
    path = tmp_path / "c.yaml"
    path.write_text("resyncSeconds: 0.5\nnodePools:\n  p: {nodeSelector: {k: v}, infiniband: true}\n"
                    "defaultNodePools: {cpu: p, gpu: p, infiniband: p}\n")
    cfg = config.load(path)
    assert cfg.resync_seconds == 0.5 and list(cfg.node_pools) == ["p"]
    assert cfg.node_pools["p"].infiniband and cfg.node_pools["p"].gpu_resource == "nvidia.com/gpu"


def test_every_crd_field_has_a_description():
    missing = []

    def walk(node, path):
        if node.get("description", "").startswith("core/v1 "):
            return  # Kubernetes' own type, copied by coreschema.py: kubectl explain pod.spec
        for key, sub in (node.get("properties") or {}).items():
            if key != "metadata" and not sub.get("description"):
                missing.append(f"{path}.{key}")
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
    walk(crds.schema("DistributedTrainingJob"), "")
    assert missing == []


def test_the_copied_core_types_keep_kubernetes_descriptions_within_the_size_etcd_takes():
    """Issue 25: `kubectl explain dtj.spec.podTemplate...` explains Kubernetes' own fields. The
    CRD is stored as one etcd object (1.5 MiB request limit): it stays under 1 MB of JSON."""
    pod = crds.schema("DistributedTrainingJob")["properties"]["spec"]["properties"]["podTemplate"][
        "properties"]["worker"]["properties"]["spec"]["properties"]
    probe = pod["containers"]["items"]["properties"]["readinessProbe"]
    assert "health check" in probe["description"]
    assert "before liveness probes" in probe["properties"]["initialDelaySeconds"]["description"]
    assert pod["volumes"]["items"]["description"].startswith("core/v1 Volume")  # where it comes from
    assert len(json.dumps(crds.crd("DistributedTrainingJob"))) < 1_000_000


SCHEMA_KEYWORDS = {"type", "description", "properties", "items", "required", "default", "enum",
                   "minimum", "maximum", "minLength", "maxLength", "maxItems", "minItems", "pattern", "format",
                   "additionalProperties", "x-kubernetes-validations", "x-kubernetes-int-or-string",
                   "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type",
                   "x-kubernetes-list-map-keys", "maxProperties"}


def test_crd_schema_nodes_use_only_openapi_keywords():
    """Catches YAML slips such as a comma inside a flow-style description splitting it into keys."""
    stray = []

    def walk(node, path):
        stray.extend(f"{path}: {k!r}" for k in node if k not in SCHEMA_KEYWORDS)
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")
        for sub in (node.get("items"), node.get("additionalProperties")):
            if isinstance(sub, dict):
                walk(sub, f"{path}[]")
    walk(crds.schema("DistributedTrainingJob"), "")
    assert stray == []
