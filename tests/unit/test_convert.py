"""`trainop convert`: the translation of Kubeflow jobs (convert.py), field by field, on the MPI
Operator's and the Training Operator's own examples (tests/fixtures/peers, copies naming their
source) and on a job that uses every field the converter reads; and the CLI around it."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import yaml

from trainop import cli, config, convert, crds, spec

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers"
CFG = config.from_dict(None)


def peer(name: str) -> dict:
    return yaml.safe_load((PEERS / name).read_text())


def warned(warnings: list[str], field: str, *words: str) -> str:
    """The one warning about `field` that holds every word; fails naming what was there."""
    hits = [w for w in warnings if w.startswith(f"{field}: ") and all(x in w for x in words)]
    assert len(hits) == 1, f"no single warning on {field} with {words}: {warnings}"
    return hits[0]


def fields(warnings: list[str]) -> set[str]:
    return {w.split(": ", 1)[0] for w in warnings}


@pytest.mark.parametrize("name", sorted(p.name for p in PEERS.glob("*.yaml")))
def test_every_peer_example_becomes_a_job_the_schema_and_the_operator_accept(name):
    for doc in yaml.safe_load_all((PEERS / name).read_text()):
        dtj, warnings = convert.convert(doc)
        assert dtj["apiVersion"] == "trainop.io/v1alpha1" and dtj["kind"] == "DistributedTrainingJob"
        assert crds.validate(crds.default(dtj)) == []
        spec.parse(dtj, CFG)  # raises SpecError if the operator would refuse it
        assert not [w for w in warnings if "would refuse" in w]
        assert all(": " in w for w in warnings)


def test_pi_carries_image_user_command_and_resources_and_names_what_it_drops():
    dtj, warnings = convert.convert(peer("mpi-pi.yaml"))
    assert dtj["metadata"] == {"name": "pi"}
    assert dtj["spec"] == {
        "framework": "pytorch", "launcher": "mpi", "image": "mpioperator/mpi-pi:openmpi", "workers": 2,
        "resources": {"limits": {"cpu": 1, "memory": "1Gi"}},
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000},
        "command": ["/home/mpiuser/pi"],
        "runPolicy": {"cleanPodPolicy": "Running"},
        "ssh": {"mountPath": "/home/mpiuser/.ssh"},
        "mpirun": {"resources": {"limits": {"cpu": 1, "memory": "1Gi"}}},
    }
    warned(warnings, "spec.runPolicy.ttlSecondsAfterFinished", "60", "dropped", "launcher Job",
           "whole DistributedTrainingJob")
    warned(warnings, "spec.sshAuthMountPath", "/home/mpiuser/.ssh", "spec.ssh.mountPath", "/etc/trainop")
    warned(warnings, "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].resources",
           "spec.mpirun.resources")
    warned(warnings, "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].command", "/usr/sbin/sshd",
           "own sshd")
    warned(warnings, "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].securityContext.runAsUser",
           "runAsGroup")
    warned(warnings, "spec.runPolicy.backoffLimit", "unset", "3 gang restarts")
    # -n 2 matches 2 workers x 1 slot: nothing to say about the rank count
    assert not [w for w in warnings if "-np" in w]


def test_intel_and_mpich_keep_their_implementation_with_a_warning():
    for name, impl in (("mpi-pi-intel.yaml", "Intel"), ("mpi-pi-mpich.yaml", "MPICH")):
        dtj, warnings = convert.convert(peer(name))
        assert dtj["spec"]["mpiImplementation"] == impl
        assert dtj["spec"]["command"] == ["/home/mpiuser/pi"]  # from args: mpirun -n 2 ...
        assert dtj["spec"]["imagePullPolicy"] == "Always"
        warned(warnings, "spec.mpiImplementation", impl, "Hydra")
        warned(warnings, "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].readinessProbe", "dropped")


def test_tensorflow_benchmarks_gpu_limit_env_and_mpirun_options():
    dtj, warnings = convert.convert(peer("mpi-tensorflow-benchmarks.yaml"))
    s = dtj["spec"]
    assert s["gpusPerWorker"] == 1 and "resources" not in s and "slotsPerWorker" not in s
    assert s["command"] == ["python", "scripts/tf_cnn_benchmarks/tf_cnn_benchmarks.py", "--model=resnet101",
                            "--batch_size=64", "--variable_update=horovod"]
    assert s["env"] == [{"name": "NCCL_DEBUG", "value": "INFO"}]
    assert s["framework"] == "tensorflow"
    launcher = "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].command"
    warned(warnings, "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].resources.limits[nvidia.com/gpu]",
           "spec.gpusPerWorker: 1")
    warned(warnings, launcher, "NCCL_DEBUG", "spec.env")
    warned(warnings, launcher, "-x LD_LIBRARY_PATH -x PATH", "dropped")
    warned(warnings, launcher, "--allow-run-as-root", "-bind-to none", "-mca pml ob1", "'^openib'")
    warned(warnings, "spec.mpiReplicaSpecs.Worker.template.spec.nodeSelector", "default gpu pool")


def test_horovod_mnist_runs_as_the_operators_user_and_says_so():
    dtj, warnings = convert.convert(peer("mpi-horovod-tensorflow-mnist.yaml"))
    assert dtj["spec"]["command"] == ["python", "/examples/tensorflow_mnist.py"]
    assert "securityContext" not in dtj["spec"]
    warned(warnings, "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].securityContext",
           "no runAsUser", "10001")


def test_pytorch_jobs_become_torchrun_jobs():
    dtj, warnings = convert.convert(peer("pytorch-simple.yaml"))
    assert dtj["metadata"] == {"name": "pytorch-simple", "namespace": "kubeflow"}
    assert dtj["spec"] == {
        "framework": "pytorch", "launcher": "torchrun",
        "image": "kubeflowkatib/pytorch-mnist:v1beta1-45c5727", "imagePullPolicy": "Always",
        "workers": 2,  # Master 1 + Worker 1
        "command": ["python3", "/opt/pytorch-mnist/mnist.py", "--epochs=1"],
        "runPolicy": {"cleanPodPolicy": "None"},
    }
    warned(warnings, "spec.runPolicy.cleanPodPolicy", "unset", "None", "Running")
    warned(warnings, "spec.pytorchReplicaSpecs.Master.restartPolicy", "OnFailure", "whole gang")
    warned(warnings, "spec.pytorchReplicaSpecs.Worker.restartPolicy", "OnFailure", "whole gang")

    dtj, warnings = convert.convert(peer("pytorch-cpu-demo.yaml"))
    assert dtj["spec"]["command"] == ["python", "demo.py"]  # torchrun's own job is trainop's
    assert dtj["spec"]["slotsPerWorker"] == 2  # nprocPerNode: "2"
    warned(warnings, "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].command", "torchrun demo.py",
           "python demo.py")

    dtj, warnings = convert.convert(peer("pytorch-mnist-gloo.yaml"))
    assert dtj["spec"]["gpusPerWorker"] == 1 and dtj["spec"]["args"] == ["--backend", "gloo"]
    assert "command" not in dtj["spec"]
    warned(warnings, "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].command", "entrypoint")


def test_torchrun_options_and_modules():
    assert convert.parse_torchrun(["--nproc_per_node", "4", "--nnodes=2", "train.py", "--lr", "1"]) == \
        (["python", "train.py", "--lr", "1"], "4")
    assert convert.parse_torchrun(["--standalone", "-m", "pkg.train", "-x"]) == \
        (["python", "-m", "pkg.train", "-x"], None)
    assert convert.parse_torchrun(["--no-python", "./run.sh"]) == (["./run.sh"], None)


def test_tfjobs_become_horovod_jobs_without_parameter_servers():
    dtj, warnings = convert.convert(peer("tfjob-dist-mnist.yaml"))
    assert dtj["spec"]["framework"] == "tensorflow" and dtj["spec"]["launcher"] == "mpi"
    assert dtj["spec"]["workers"] == 4  # the PS replicas are not workers
    warned(warnings, "spec.tfReplicaSpecs.PS", "dropped", "parameter servers")
    warned(warnings, "spec.tfReplicaSpecs", "TF_CONFIG", "Horovod")
    warned(warnings, "spec.tfReplicaSpecs.Worker.restartPolicy", "Never")
    dtj, _ = convert.convert(peer("tfjob-simple.yaml"))
    assert dtj["spec"]["command"] == ["python", "/var/tf_mnist/mnist_with_summaries.py"]


def test_mpirun_lines():
    launch = convert.parse_launch(["sh", "-c", "mpirun -np 8 -x A=1 -x B -genv C 2 --mca btl tcp python t.py -n 3"])
    assert launch.program == ["python", "t.py", "-n", "3"] and launch.ranks == "8"
    assert launch.env == [{"name": "A", "value": "1"}, {"name": "C", "value": "2"}]
    assert launch.forwarded == ["B"] and launch.dropped == ["--mca btl tcp"]
    assert convert.parse_launch(["horovodrun", "-np", "4", "-H", "a:2,b:2", "python", "x.py"]).program == \
        ["python", "x.py"]
    assert convert.parse_launch(["python", "x.py"]) is None
    assert convert.parse_launch(["sh", "-c", "cd /x && mpirun python x.py"]) is None  # not one command


# A job that uses every field the converter reads, the way a real MPIJob spells it.
FULL = yaml.safe_load("""
apiVersion: kubeflow.org/v2beta1
kind: MPIJob
metadata:
  name: full
  namespace: team-a
  labels: {kueue.x-k8s.io/queue-name: team-a-queue, app: bert}
spec:
  runLauncherAsWorker: true
  runPolicy:
    backoffLimit: 2
    ttlSecondsAfterFinished: 600
    activeDeadlineSeconds: 7200
    managedBy: kubeflow.org/mpi-operator
    schedulingPolicy: {minAvailable: 3, queue: research, priorityClass: high}
  mpiReplicaSpecs:
    Launcher:
      replicas: 1
      template:
        spec:
          nodeSelector: {kubernetes.azure.com/agentpool: gpu, role: launcher}
          containers:
          - name: launcher
            image: example/launcher:1
            command: [mpirun, -np, "8", --map-by, "ppr:4:node", --hostfile, /etc/mpi/hostfile, -x, NCCL_DEBUG=INFO, python, /train.py]
            resources: {limits: {cpu: 2}}
    Worker:
      replicas: 1
      restartPolicy: ExitCode
      template:
        metadata:
          labels: {app: bert, trainop.io/role: x}
        spec:
          serviceAccountName: trainer
          terminationGracePeriodSeconds: 120
          imagePullSecrets: [{name: regcred}]
          nodeSelector: {kubernetes.azure.com/agentpool: gpu}
          tolerations: [{key: sku, operator: Equal, value: gpu, effect: NoSchedule}]
          affinity: {podAntiAffinity: {preferredDuringSchedulingIgnoredDuringExecution: [{weight: 1, podAffinityTerm: {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: bert}}}}]}}
          securityContext: {runAsUser: 0}
          volumes:
          - {name: dshm, emptyDir: {medium: Memory, sizeLimit: 16Gi}}
          - {name: data, persistentVolumeClaim: {claimName: corpus}}
          - {name: token, secret: {secretName: hf-token}}
          - {name: host, hostPath: {path: /mnt}}
          containers:
          - name: worker
            image: example/train:1
            ports: [{containerPort: 2222}]
            env:
            - {name: MODE, value: train}
            - {name: NVIDIA_VISIBLE_DEVICES, value: all}
            - {name: CFG, valueFrom: {configMapKeyRef: {name: settings, key: cfg}}}
            - {name: HF_TOKEN, valueFrom: {secretKeyRef: {name: hf-token, key: token}}}
            envFrom: [{configMapRef: {name: settings}}]
            volumeMounts:
            - {name: dshm, mountPath: /dev/shm}
            - {name: data, mountPath: /corpus}
            - {name: token, mountPath: /token}
            - {name: host, mountPath: /mnt}
            resources: {limits: {nvidia.com/gpu: 4, cpu: 16, memory: 64Gi, example.com/fpga: 1}}
          - name: exporter
            image: example/exporter:1
            resources: {limits: {cpu: 100m, nvidia.com/gpu: 1}}
""")


def test_every_field_of_a_full_mpijob():
    dtj, warnings = convert.convert(copy.deepcopy(FULL))
    s = dtj["spec"]
    assert dtj["metadata"] == {"name": "full", "namespace": "team-a", "labels": {"app": "bert"}}
    assert s["queue"] == "team-a-queue"
    assert s["image"] == "example/train:1"
    assert s["workers"] == 1  # and the launcher runs ranks too (mpirun.runLauncherAsWorker)
    assert s["gpusPerWorker"] == 4 and s["slotsPerWorker"] == 1
    assert s["resources"] == {"limits": {"cpu": 16, "memory": "64Gi"}}
    assert s["shmSize"] == "16Gi"
    assert s["command"] == ["python", "/train.py"]
    assert s["env"] == [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "MODE", "value": "train"}]
    assert s["nodePool"] == {"nodeSelector": {"kubernetes.azure.com/agentpool": "gpu"},
                             "tolerations": [{"key": "sku", "operator": "Equal", "value": "gpu",
                                              "effect": "NoSchedule"}]}
    assert s["priorityClassName"] == "high"
    assert s["runPolicy"] == {"backoffLimit": 2, "cleanPodPolicy": "None", "activeDeadlineSeconds": 7200}
    assert s["mpirun"] == {"image": "example/launcher:1", "runLauncherAsWorker": True,
                           "extraArgs": ["--map-by", "ppr:4:node"]}
    assert s["terminationGracePeriodSeconds"] == 120
    assert "securityContext" not in s
    worker = s["podTemplate"]["worker"]
    assert worker["metadata"] == {"labels": {"app": "bert"}}
    assert worker["spec"]["volumes"] == [{"name": "user-data", "persistentVolumeClaim": {"claimName": "corpus"}}]
    assert worker["spec"]["containers"][0] == {
        "name": "worker", "env": [{"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "cfg"}}}],
        "volumeMounts": [{"name": "user-data", "mountPath": "/corpus"}]}
    assert worker["spec"]["containers"][1] == {"name": "exporter", "image": "example/exporter:1",
                                               "resources": {"limits": {"cpu": "100m"}}}
    assert "podAntiAffinity" in worker["spec"]["affinity"]
    assert "imagePullSecrets" not in worker["spec"]
    assert s["podTemplate"]["launcher"] == {"spec": {"nodeSelector": {"role": "launcher"}}}

    run, pod, c = "spec.runPolicy", "spec.mpiReplicaSpecs.Worker.template.spec", \
        "spec.mpiReplicaSpecs.Worker.template.spec.containers[0]"
    launcher = "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0]"
    warned(warnings, f"{run}.managedBy", "kubeflow.org/mpi-operator", "dropped", "never run")
    warned(warnings, f"{run}.ttlSecondsAfterFinished", "600", "dropped")
    warned(warnings, f"{run}.backoffLimit", "2", "launcher Job alone", "whole gang")
    warned(warnings, f"{run}.cleanPodPolicy", "unset", "None")
    warned(warnings, f"{run}.schedulingPolicy.minAvailable", "3", "dropped", "workers only")
    warned(warnings, f"{run}.schedulingPolicy.queue", "research", "gangScheduling.allowedQueues")
    warned(warnings, f"{run}.schedulingPolicy.priorityClass", "spec.priorityClassName: high")
    warned(warnings, "spec.runLauncherAsWorker", "became spec.mpirun.runLauncherAsWorker")
    warned(warnings, "spec.slotsPerWorker", "unset", "slotsPerWorker: 1")
    warned(warnings, f"{launcher}.image", "example/launcher:1", "spec.mpirun.image")
    warned(warnings, f"{launcher}.resources", "dropped", "workers' resources")
    warned(warnings, f"{launcher}.command", "carried over", "--map-by ppr:4:node")
    warned(warnings, f"{launcher}.command", "dropped", "--hostfile /etc/mpi/hostfile")
    warned(warnings, f"{pod}.terminationGracePeriodSeconds", "120", "spec.terminationGracePeriodSeconds")
    warned(warnings, f"{launcher}.command", "-np 8", "2 ranks")
    warned(warnings, f"{launcher}.command", "NCCL_DEBUG", "spec.env")
    warned(warnings, "spec.mpiReplicaSpecs.Worker.restartPolicy", "ExitCode", "failurePolicy")
    warned(warnings, "metadata.labels[kueue.x-k8s.io/queue-name]", "spec.queue")
    warned(warnings, f"{pod}.serviceAccountName", "trainer", "dropped")
    warned(warnings, f"{pod}.imagePullSecrets[0]", "regcred", "podTemplate.allow.secrets")
    warned(warnings, f"{pod}.securityContext.runAsUser", "root", "dropped")
    warned(warnings, f"{pod}.nodeSelector", "spec.nodePool.nodeSelector")
    warned(warnings, f"{pod}.volumes[0]", "spec.shmSize", "16Gi")
    warned(warnings, f"{pod}.volumes[1]", "renamed user-data")
    warned(warnings, f"{pod}.volumes[2]", "hf-token", "dropped")
    warned(warnings, f"{pod}.volumes[3]", "hostPath", "podTemplate.allow.hostPath")
    warned(warnings, f"{pod}.containers[1]", "exporter", "extra container")
    warned(warnings, f"{pod}.containers[1].resources.limits[nvidia.com/gpu]", "dropped")
    warned(warnings, "spec.mpiReplicaSpecs.Worker.template.metadata.labels", "trainop.io/")
    warned(warnings, f"{c}.env[1]", "NVIDIA_VISIBLE_DEVICES", "dropped")
    warned(warnings, f"{c}.env[3]", "hf-token", "dropped")
    warned(warnings, f"{c}.envFrom[0]", "dropped", "NVIDIA_VISIBLE_DEVICES", "configMapKeyRef")
    warned(warnings, f"{c}.ports", "dropped")
    warned(warnings, f"{c}.resources.limits[example.com/fpga]", "dropped")
    warned(warnings, f"{c}.resources.limits[nvidia.com/gpu]", "spec.gpusPerWorker: 4")
    assert not [w for w in warnings if "would refuse" in w], warnings
    spec.parse(dtj, CFG)


def test_what_the_admin_allows_is_kept():
    cfg = config.from_dict({"podTemplate": {"allow": {"secrets": ["team-a/hf-token", "regcred"],
                                                      "hostPath": True, "envFromWithoutPrefix": True}},
                            "gangScheduling": {"allowedQueues": ["research"]}})
    dtj, warnings = convert.convert(copy.deepcopy(FULL), cfg)
    worker = dtj["spec"]["podTemplate"]["worker"]["spec"]
    assert [v["name"] for v in worker["volumes"]] == ["user-data", "token", "host"]
    assert worker["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "token", "mountPath": "/token"} in worker["containers"][0]["volumeMounts"]
    assert worker["containers"][0]["envFrom"] == [{"configMapRef": {"name": "settings"}}]
    assert dtj["spec"]["runPolicy"]["schedulingPolicy"] == {"queue": "research"}
    assert not [w for w in warnings if "hf-token" in w or "hostPath" in w]


def test_a_worker_env_that_conflicts_with_the_launchers_is_reported():
    job = copy.deepcopy(FULL)
    job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "MODE", "value": "eval"}]
    dtj, warnings = convert.convert(job)
    assert {"name": "MODE", "value": "eval"} in dtj["spec"]["env"]
    warned(warnings, "spec.mpiReplicaSpecs.Worker.template.spec.containers[0].env[0]", "MODE", "'eval'")


def test_an_unparsable_launcher_command_leaves_spec_command_out_and_says_so():
    job = copy.deepcopy(FULL)
    job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"] = \
        ["/bin/sh", "-c", "mpirun -np 2 python a.py; echo done"]
    dtj, warnings = convert.convert(job)
    assert "command" not in dtj["spec"]
    warned(warnings, "spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].command", "set spec.command")


def test_a_name_the_crd_refuses_is_reported():
    job = copy.deepcopy(FULL)
    job["metadata"]["name"] = "x" * 60
    _, warnings = convert.convert(job)
    warned(warnings, "metadata.name", "48")


@pytest.mark.parametrize("obj, message", [
    ({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "a"}}, "Job (batch/v1) is not a kind"),
    ({"apiVersion": "kubeflow.org/v1", "kind": "MPIJob", "metadata": {"name": "a"}}, "MPIJob (kubeflow.org/v1)"),
    ({"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": "a"}, "spec": {}},
     "Launcher: missing"),
    ({"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {}}, "metadata.name"),
    (["a"], "got a YAML list"),
])
def test_what_it_cannot_convert(obj, message):
    with pytest.raises(convert.ConvertError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert.convert(obj)


# ---- the CLI ---------------------------------------------------------------------------------------

def test_cli_writes_every_document_and_warns_on_stderr(tmp_path, capsys, monkeypatch):
    both = (PEERS / "mpi-pi.yaml").read_text() + "\n---\n" + (PEERS / "tfjob-simple.yaml").read_text()
    monkeypatch.setattr("sys.stdin", io.StringIO(both))
    assert cli.main(["convert"]) == 0
    out, err = capsys.readouterr()
    jobs = list(yaml.safe_load_all(out))
    assert [j["metadata"]["name"] for j in jobs] == ["pi", "tfjob-simple"]
    assert "warning: pi: spec.runPolicy.ttlSecondsAfterFinished: 60: dropped" in err
    assert "warning: tfjob-simple: spec.tfReplicaSpecs: TF_CONFIG" in err
    target = tmp_path / "out.yaml"
    assert cli.main(["convert", str(PEERS / "mpi-pi.yaml"), "-o", str(target)]) == 0
    assert capsys.readouterr().out == ""
    assert yaml.safe_load(target.read_text())["spec"]["command"] == ["/home/mpiuser/pi"]


@pytest.mark.parametrize("text, message", [
    ("apiVersion: batch/v1\nkind: Job\nmetadata: {name: a}\n", "is not a kind trainop convert reads"),
    ("spec: [\n", "not valid YAML at line 2"),
    ("", "no document to convert"),
])
def test_cli_refuses_with_a_clear_message(text, message, tmp_path, capsys):
    path = tmp_path / "in.yaml"
    path.write_text(text)
    assert cli.main(["convert", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"trainop convert: {path}" in err and message in err
    assert cli.main(["convert", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_a_training_operator_ttl_is_kept_and_its_managed_by_dropped():
    job = peer("pytorch-simple.yaml")
    job["spec"]["runPolicy"] = {"ttlSecondsAfterFinished": 60, "managedBy": "kubeflow.org/training-operator",
                                "cleanPodPolicy": "All", "schedulingPolicy": {"minAvailable": 1}}
    dtj, warnings = convert.convert(job)
    # the Training Operator deletes the whole job too: the same meaning
    assert dtj["spec"]["runPolicy"] == {"ttlSecondsAfterFinished": 60, "cleanPodPolicy": "All",
                                        "schedulingPolicy": {"minAvailable": 1}}
    assert "spec.runPolicy.ttlSecondsAfterFinished" not in fields(warnings)
    warned(warnings, "spec.runPolicy.managedBy", "kubeflow.org/training-operator", "dropped")
    warned(warnings, "spec.runPolicy.schedulingPolicy.minAvailable", "became 1")
    spec.parse(dtj, CFG)


def test_a_root_job_stays_root_where_the_admin_allows_it():
    """The MPI Operator's pi example as root (runAsUser 0): dropped with the built-in
    configuration, kept where podTemplate.allow.privileged lets trainop run root jobs."""
    mpijob = peer("mpi-pi.yaml")
    for role in mpijob["spec"]["mpiReplicaSpecs"].values():
        role["template"]["spec"]["containers"][0]["securityContext"] = {"runAsUser": 0}
    dtj, warnings = convert.convert(copy.deepcopy(mpijob))
    assert "securityContext" not in dtj["spec"] and any("0 (root): dropped" in w for w in warnings)
    allowed = config.from_dict({"podTemplate": {"allow": {"privileged": True}}})
    dtj, warnings = convert.convert(copy.deepcopy(mpijob), allowed)
    assert dtj["spec"]["securityContext"] == {"runAsUser": 0, "runAsGroup": 0}
    assert spec.parse(dtj | {"metadata": {"name": "pi", "namespace": "x"}}, allowed).security.root
