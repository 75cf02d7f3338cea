"""render/dtj.py: every child of a DistributedTrainingJob, with explicit expected values."""

import base64
import dataclasses
import shlex
import subprocess

import pytest

from trainop import config
from trainop.render import dtj
from trainop.spec import SpecError, parse

CFG = config.load(None)
GPU_TOL = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def job(**spec):
    return parse({"metadata": {"name": "j1", "namespace": "team-a"}, "spec": spec}, CFG)


def test_names_and_hosts():
    j = job(workers=2)
    assert (dtj.service_name(j), dtj.secret_name(j), dtj.config_map_name(j)) == ("j1", "j1-ssh", "j1-mpi")
    assert (dtj.worker_name(j, 1), dtj.launcher_name(j)) == ("j1-worker-1", "j1-launcher")
    assert dtj.host(j, 1) == "j1-worker-1.j1.team-a.svc"


def test_hostfile_formats():
    assert dtj.hostfile(job(workers=2, gpusPerWorker=4)) == (
        "j1-worker-0.j1.team-a.svc slots=4\nj1-worker-1.j1.team-a.svc slots=4\n")
    assert dtj.hostfile(job(workers=2, gpusPerWorker=4, mpiImplementation="Intel")) == (
        "j1-worker-0.j1.team-a.svc:4\nj1-worker-1.j1.team-a.svc:4\n")
    assert dtj.hostfile(job(workers=1, mpiImplementation="MPICH", slotsPerWorker=2)) == (
        "j1-worker-0.j1.team-a.svc:2\n")


def test_service_is_headless_and_selects_workers():
    assert dtj.render_service(job(workers=2)) == {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "j1", "namespace": "team-a", "labels": {"trainop.io/job-name": "j1"}},
        "spec": {"clusterIP": "None",
                 "selector": {"trainop.io/job-name": "j1", "trainop.io/role": "worker"},
                 "ports": [{"name": "ssh", "port": 2222, "protocol": "TCP", "targetPort": 2222}]},
    }
    torch = dtj.render_service(job(launcher="torchrun"))
    assert torch["spec"]["ports"] == [{"name": "rendezvous", "port": 29400, "protocol": "TCP",
                                       "targetPort": 29400}]


def test_ssh_secret_pins_the_host_key():
    secret = dtj.render_ssh_secret(job(), "PRIVATE\n", "ssh-ed25519 AAAAkey trainop")
    files = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert files == {"id_ed25519": "PRIVATE\n", "id_ed25519.pub": "ssh-ed25519 AAAAkey trainop\n",
                     "authorized_keys": "ssh-ed25519 AAAAkey trainop\n",
                     "known_hosts": "* ssh-ed25519 AAAAkey trainop\n"}
    assert secret["metadata"]["name"] == "j1-ssh" and secret["type"] == "Opaque"


def test_config_map_files():
    data = dtj.render_config_map(job(workers=2))["data"]
    assert data["hosts"] == "j1-worker-0.j1.team-a.svc\nj1-worker-1.j1.team-a.svc\n"
    assert "Port 2222\n" in data["sshd_config"]
    assert "HostKey /etc/trainop/ssh/id_ed25519\n" in data["sshd_config"]
    assert "AuthorizedKeysFile /etc/trainop/ssh/authorized_keys\n" in data["sshd_config"]
    assert "PasswordAuthentication no\n" in data["sshd_config"]
    assert "PermitRootLogin no\n" in data["sshd_config"] and "PidFile none\n" in data["sshd_config"]
    assert "  StrictHostKeyChecking yes\n" in data["ssh_config"]
    assert "  UserKnownHostsFile /etc/trainop/ssh/known_hosts\n" in data["ssh_config"]
    assert data["ssh"] == '#!/bin/sh\nexec ssh -F /etc/trainop/mpi/ssh_config "$@"\n'
    # every session gets the worker container's environment back (tests/mpi/test_mpi_sshd.py)
    assert "ForceCommand /etc/trainop/mpi/ssh-session\n" in data["sshd_config"]
    assert ". /dev/shm/trainop-worker-env" in data["ssh-session"]


def test_gpu_worker_pod():
    pod = dtj.render_worker(job(workers=2, gpusPerWorker=4,
                                resources={"requests": {"cpu": "8", "memory": "64Gi"}},
                                data={"dataStageRef": {"name": "imagenet"}, "mountPath": "/imagenet"}),
                            1, attempt=2, claim_name="imagenet-data")
    assert pod["metadata"] == {"name": "j1-worker-1", "namespace": "team-a", "labels": {
        "trainop.io/job-name": "j1", "trainop.io/role": "worker", "trainop.io/replica-index": "1",
        "trainop.io/attempt": "2", "trainop.io/reads-datastage": "imagenet"}}  # the NFS server's policy admits it
    spec = pod["spec"]
    assert (spec["hostname"], spec["subdomain"], spec["restartPolicy"]) == ("j1-worker-1", "j1", "Never")
    assert spec["nodeSelector"] == {"kubernetes.azure.com/agentpool": "gpu"}
    assert spec["tolerations"] == [GPU_TOL]
    (c,) = spec["containers"]
    assert c["command"][:2] == ["sh", "-c"]  # the script's behaviour: tests/mpi/test_mpi_sshd.py
    assert "(umask 077 && export -p > /dev/shm/trainop-worker-env)\n" \
        "/usr/sbin/sshd -D -e -f /etc/trainop/mpi/sshd_config &\n" in c["command"][2]
    assert c["resources"] == {"requests": {"cpu": "8", "memory": "64Gi"},
                              "limits": {"nvidia.com/gpu": 4}}
    assert c["readinessProbe"]["tcpSocket"] == {"port": 2222}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "imagenet-data",
                                                                         "readOnly": True}}
    assert volumes["ssh"]["secret"] == {"secretName": "j1-ssh", "defaultMode": 0o440}
    assert volumes["mpi"]["configMap"]["name"] == "j1-mpi"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["shm"]["mountPath"] == "/dev/shm"
    assert mounts["data"] == {"name": "data", "mountPath": "/imagenet", "readOnly": True}
    assert mounts["ssh"] == {"name": "ssh", "mountPath": "/etc/trainop/ssh", "readOnly": True}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_IB_DISABLE"] == "1" and env["OMPI_MCA_btl"] == "self,vader,tcp"


BLOB_OUTPUT = {"blob": {"accountURL": "https://a.blob.core.windows.net", "container": "results",
                        "auth": {"sasSecretRef": {"name": "storage", "key": "sas"}}}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# The MPI worker's training container: NET_BIND_SERVICE in the bounding set, for sshd binaries
# with that file capability (the MPI Operator's images); restricted Pod Security allows it.
MPI_WORKER_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}


def expected_security(spec: dict, container: dict) -> dict:
    mpi_worker = container["name"] == "worker" and "-c" in container.get("command", []) \
        and "/usr/sbin/sshd" in container["command"][-1]
    return MPI_WORKER_CONTAINER if mpi_worker else RESTRICTED_CONTAINER


def pod_specs(j):
    """Every pod the job renders: its workers and, for mpi, the launcher's template."""
    out = [dtj.render_worker(j, i, attempt=0)["spec"] for i in range(j.workers)]
    if j.launcher == "mpi":
        out.append(dtj.render_launcher(j, attempt=0)["spec"]["template"]["spec"])
    return out


def test_every_pod_runs_as_the_images_non_root_user_without_privileges():
    j = job(workers=2, output=BLOB_OUTPUT)
    for spec in pod_specs(j) + pod_specs(job(launcher="torchrun", workers=2)):
        assert spec["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"] == expected_security(spec, c), c["name"]
    # worker 0 and the launcher ship logs: the sidecar is covered above
    assert [c["name"] for c in pod_specs(j)[0]["initContainers"]] == ["logship"]


def test_a_custom_image_runs_as_its_own_user():
    j = job(image="mpioperator/mpi-pi", command=["/home/mpiuser/pi"],
            securityContext={"runAsUser": 1000, "runAsGroup": 1000})
    for spec in pod_specs(j):
        ctx = spec["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"], ctx["runAsNonRoot"]) == (1000, 1000, 1000, True)
        # the operator's ssh files stay under /etc/trainop; the image's ~/.ssh is not mounted over
        assert {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]} >= {"/etc/trainop/ssh", "/etc/trainop/mpi"}
        assert not any(m["mountPath"].startswith("/home") for m in spec["containers"][0]["volumeMounts"])


def test_root_where_the_admin_allows_it_gets_what_root_sshd_and_mpirun_need():
    """Measured with the MPI Operator's Open MPI 5 image as root on a real node: sshd's
    privilege separation needs chroot and setuid, Open MPI 5's mpirun crashes under drop ALL and
    refuses root unless told twice; ssh and sshd refuse a root-owned key that its group reads."""
    allowed = config.from_dict({"podTemplate": {"allow": {"privileged": True}}})

    def admitted(**spec):
        return parse({"metadata": {"name": "j1", "namespace": "team-a"}, "spec": spec}, allowed)
    j = admitted(workers=2, image="mpioperator/mpi-pi:openmpi", command=["/home/mpiuser/pi"],
                 securityContext={"runAsUser": 0, "runAsGroup": 0})
    for spec in pod_specs(j):
        # no fsGroup: the kubelet would OR 0440 into the key's mode, which root's ssh refuses
        assert spec["securityContext"] == {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0,
                                           "seccompProfile": {"type": "RuntimeDefault"}}
        training = spec["containers"][0]
        assert training["securityContext"] == {"allowPrivilegeEscalation": False}  # the runtime's capabilities
        assert {v["name"]: v for v in spec["volumes"]}["ssh"]["secret"]["defaultMode"] == 0o400
        env = {e["name"]: e.get("value") for e in training["env"]}
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert "PermitRootLogin prohibit-password\n" in dtj.render_config_map(j)["data"]["sshd_config"]
    assert "mkdir -p /run/sshd\n" in dtj.render_worker(j, 0, 0)["spec"]["containers"][0]["command"][2]
    assert "-x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" in shlex.join(dtj.mpirun_command(j))
    # a non-root job keeps none of it
    plain = admitted(workers=2)
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in str(pod_specs(plain)) and "mkdir -p /run/sshd" not in str(pod_specs(plain))
    assert "PermitRootLogin no\n" in dtj.render_config_map(plain)["data"]["sshd_config"]


def test_infiniband_adds_no_capability():
    """IPC_LOCK would buy nothing: Kubernetes sets no ambient capabilities, so a non-root rank
    never holds it; registration is bounded by the node's RLIMIT_MEMLOCK (docs/security.md)."""
    for spec in pod_specs(job(workers=2, gpusPerWorker=8, infiniband=True)):
        for c in spec["containers"]:
            assert c["securityContext"] == expected_security(spec, c)


def test_infiniband_worker_requests_rdma_and_sets_transport():
    pod = dtj.render_worker(job(gpusPerWorker=8, infiniband=True), 0, attempt=0)
    (c,) = pod["spec"]["containers"]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": 8, "rdma/ib": 1}}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_IB_DISABLE"] == "0" and env["UCX_TLS"] == "rc,sm,self"
    assert env["OMPI_MCA_pml"] == "ucx" and env["OMPI_MCA_btl"] == "^openib"
    assert pod["spec"]["nodeSelector"] == {"kubernetes.azure.com/agentpool": "ibgpu"}


def test_rdma_resource_name_from_configuration():
    cfg = config.from_dict({"nodePools": {"nd": {"nodeSelector": {"p": "nd"}, "infiniband": True,
                                                 "rdmaResource": "rdma/hca_shared_devices_a"}},
                            "defaultNodePools": {"cpu": "nd", "gpu": "nd", "infiniband": "nd"}})
    j = parse({"metadata": {"name": "j1", "namespace": "n"}, "spec": {"gpusPerWorker": 8, "infiniband": True}}, cfg)
    limits = dtj.render_worker(j, 0, 0)["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 8, "rdma/hca_shared_devices_a": 1}


def test_user_env_wins_and_is_forwarded():
    j = job(env=[{"name": "NCCL_IB_DISABLE", "value": "0"}, {"name": "FOO", "value": "bar"}])
    names = [e["name"] for e in dtj.container_env(j)]
    assert names == ["PYTHONUNBUFFERED", "TRAINOP_JOB_NAME", "OMPI_MCA_pml", "OMPI_MCA_btl",
                     "OMPI_MCA_orte_default_hostfile", "NCCL_IB_DISABLE", "FOO"]
    cmd = dtj.mpirun_command(j)
    assert "-x FOO" in shlex.join(cmd) and "-x NCCL_IB_DISABLE" in shlex.join(cmd)


def test_ranks_are_told_the_hostfile():
    """Ranks on several pods need every rank's host (trainop_trainer.world reads the hostfile
    that Open MPI's own variable names); mpirun forwards it to them."""
    env = {e["name"]: e.get("value") for e in dtj.container_env(job(workers=2))}
    assert env["OMPI_MCA_orte_default_hostfile"] == "/etc/trainop/mpi/hostfile"
    assert "-x OMPI_MCA_orte_default_hostfile" in shlex.join(dtj.mpirun_command(job(workers=2)))
    for other in (job(workers=2, launcher="torchrun"), job(workers=2, mpiImplementation="Intel")):
        assert "OMPI_MCA_orte_default_hostfile" not in {e["name"] for e in dtj.container_env(other)}


def test_launcher_job():
    j = job(workers=2, gpusPerWorker=4, training={"batchSize": 128, "epochs": 3, "precision": "bf16",
                                                  "channelsLast": True})
    launcher = dtj.render_launcher(j, attempt=1)
    assert launcher["metadata"]["name"] == "j1-launcher"
    assert launcher["metadata"]["labels"]["trainop.io/role"] == "launcher"
    assert launcher["spec"]["backoffLimit"] == 0
    pod = launcher["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["tolerations"] == [GPU_TOL]
    (c,) = pod["containers"]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi"}}
    assert "nvidia.com/gpu" not in str(c["resources"])
    script = c["command"][2]
    assert c["command"][:2] == ["sh", "-c"]
    assert script.startswith("set -eu\ndeadline=$(($(date +%s) + 300))\n"
                             "for host in $(cat /etc/trainop/mpi/hosts); do\n")
    # mpirun in the background: the shell takes the kubelet's SIGTERM (tests/mpi/test_mpi_sshd.py)
    mpirun = next(line for line in script.splitlines() if line.startswith("mpirun "))
    assert mpirun == (
        "mpirun -np 8 --hostfile /etc/trainop/mpi/hostfile --map-by slot "
        "--bind-to none --mca orte_keep_fqdn_hostnames 1 --mca plm_rsh_no_tree_spawn 1 "
        "--mca plm_rsh_agent ssh --mca plm_rsh_args '-F /etc/trainop/mpi/ssh_config' "
        "-x PATH -x PYTHONUNBUFFERED -x TRAINOP_JOB_NAME -x NCCL_IB_DISABLE -x OMPI_MCA_pml "
        "-x OMPI_MCA_btl -x OMPI_MCA_orte_default_hostfile python -m trainop_trainer --framework pytorch --backend horovod "
        "--synthetic --batch-size 128 --epochs 3 --precision bf16 --channels-last "
        "--output-dir /output --metrics-file /output/metrics.jsonl &")


def test_hydra_mpirun():
    assert dtj.mpirun_command(job(workers=2, mpiImplementation="Intel", command=["a.out"])) == [
        "mpirun", "-f", "/etc/trainop/mpi/hostfile", "-n", "2", "-ppn", "1", "-bootstrap", "ssh",
        "-bootstrap-exec", "/etc/trainop/mpi/ssh", "a.out"]
    assert dtj.mpirun_command(job(mpiImplementation="MPICH", command=["a.out"]))[7:13] == [
        "-launcher", "ssh", "-launcher-exec", "/etc/trainop/mpi/ssh", "${TRAINOP_POD_IP:+-localhost $TRAINOP_POD_IP}",
        "a.out"]


def test_mpich_proxies_call_the_launcher_back_at_its_pod_ip():
    """Hydra's proxies reach mpiexec at the name it gives them, by default the launcher pod's
    hostname, which no worker resolves: MPICH's launcher passes its pod IP (downward API),
    expanded by its shell, never quoted."""
    launcher = dtj.render_launcher(job(workers=2, mpiImplementation="MPICH", command=["a.out"]), attempt=0)
    (c,) = launcher["spec"]["template"]["spec"]["containers"]
    assert {"name": "TRAINOP_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    mpirun = next(line for line in c["command"][2].splitlines() if line.startswith("mpirun "))
    assert mpirun == ("mpirun -f /etc/trainop/mpi/hostfile -n 2 -ppn 1 -launcher ssh -launcher-exec "
                      "/etc/trainop/mpi/ssh ${TRAINOP_POD_IP:+-localhost $TRAINOP_POD_IP} a.out &")
    expanded = subprocess.run(["sh", "-c", f'set -- {mpirun.removesuffix(" &")}; printf "%s\\n" "$@"'],
                              env={"TRAINOP_POD_IP": "10.1.2.3"}, capture_output=True, text=True).stdout
    assert expanded.splitlines()[-4:] == ["/etc/trainop/mpi/ssh", "-localhost", "10.1.2.3", "a.out"]
    for other in ("OpenMPI", "Intel"):
        rendered = dtj.render_launcher(job(workers=2, mpiImplementation=other), attempt=0)
        assert "TRAINOP_POD_IP" not in str(rendered)


def test_mpirun_extra_args_go_before_the_program_and_replace_the_mapping():
    j = job(workers=2, command=["a.out"], mpirun={"extraArgs": ["--mca", "btl_tcp_if_include", "eth0",
                                                                "--map-by", "ppr:1:node", "-x", "MY_VAR"]})
    cmd = dtj.mpirun_command(j)
    assert cmd[-8:] == ["--mca", "btl_tcp_if_include", "eth0", "--map-by", "ppr:1:node", "-x", "MY_VAR", "a.out"]
    assert cmd.count("--map-by") == 1 and cmd[cmd.index("--bind-to") + 1] == "none"  # theirs; ours
    hydra = dtj.mpirun_command(job(mpiImplementation="MPICH", command=["a.out"],
                                   mpirun={"extraArgs": ["-bind-to", "core"]}))
    assert hydra[-3:] == ["-bind-to", "core", "a.out"]


@pytest.mark.parametrize("args, index, says", [
    (["-np", "64"], 0, "rank count"), (["--np=64"], 0, "rank count"), (["-H", "evil:8"], 0, "hosts"),
    (["--hostfile", "/tmp/h"], 0, "hosts"), (["-f", "/tmp/h"], 0, "hosts"), (["-ppn", "8"], 0, "hosts"),
    (["-launcher-exec", "/bin/sh"], 0, "ssh transport"), (["--app", "x"], 0, "program"),
    (["-x", "A", "--mca", "plm_rsh_agent", "rsh"], 3, "ssh transport"),
    (["--prtemca", "plm_ssh_args", "-p 22"], 1, "ssh transport"),
])
def test_mpirun_flags_that_would_break_the_gang_are_refused(args, index, says):
    with pytest.raises(SpecError) as err:
        job(mpirun={"extraArgs": args})
    assert err.value.field == f"spec.mpirun.extraArgs[{index}]" and says in str(err.value)


def test_a_launcher_command_of_the_users_own():
    """spec.mpirun.command replaces the rendered mpirun; $(VAR) is replaced as Kubernetes does in
    a container's command, and the launcher's environment has the same names."""
    j = job(workers=2, gpusPerWorker=4, mpirun={
        "command": ["horovodrun", "-np", "$(TRAINOP_NUM_RANKS)", "--hostfile", "$(TRAINOP_HOSTFILE)",
                    "-p", "$(TRAINOP_SSH_PORT)", "python", "train.py", "--cost", "$$(NOT_A_VAR)", "$(HOME)"],
        "image": "example/launcher:1", "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}})
    pod = dtj.render_launcher(j, attempt=0)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    line = next(x for x in c["command"][2].splitlines() if x.startswith("horovodrun "))
    assert line == ("horovodrun -np 8 --hostfile /etc/trainop/mpi/hostfile -p 2222 python train.py "
                    "--cost '$(NOT_A_VAR)' '$(HOME)' &")
    assert c["image"] == "example/launcher:1" and c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TRAINOP_NUM_RANKS"] == "8" and env["TRAINOP_SSH"] == "/etc/trainop/mpi/ssh"
    assert dtj.render_worker(j, 0, 0)["spec"]["containers"][0]["image"] == j.image  # workers keep spec.image
    with pytest.raises(SpecError) as err:
        job(launcher="torchrun", mpirun={"image": "x"})
    assert err.value.field == "spec.mpirun"
    with pytest.raises(SpecError) as err:
        job(mpirun={"resources": {"limits": {"nvidia.com/gpu": 1}}})
    assert err.value.field in ("spec.mpirun.resources.limits", "spec.mpirun.resources.limits[nvidia.com/gpu]")


@pytest.mark.parametrize("user, mode", [(1000, 0o440), (0, 0o400)])
def test_ssh_mount_path_puts_the_key_where_the_image_looks(user, mode):
    j = job(workers=2, ssh={"mountPath": "/home/mpiuser/.ssh/"})
    j = dataclasses.replace(j, security=dataclasses.replace(j.security, run_as_user=user))
    for pod in (dtj.render_worker(j, 0, 0)["spec"], dtj.render_launcher(j, 0)["spec"]["template"]["spec"]):
        volume = next(v for v in pod["volumes"] if v["name"] == "ssh-auth")
        assert volume["secret"] == {"secretName": "j1-ssh", "defaultMode": mode, "items": [
            {"key": "id_ed25519", "path": "id_rsa"}, {"key": "id_ed25519.pub", "path": "id_rsa.pub"},
            {"key": "authorized_keys", "path": "authorized_keys"}, {"key": "known_hosts", "path": "known_hosts"}]}
        assert {"name": "ssh-auth", "mountPath": "/home/mpiuser/.ssh", "readOnly": True} in \
            pod["containers"][0]["volumeMounts"]


@pytest.mark.parametrize("path", ["/etc/trainop/ssh", "/etc", "/", "/output/keys", "/data", "/a/../etc/trainop"])
def test_ssh_mount_path_may_not_cover_the_operators_mounts(path):
    with pytest.raises(SpecError) as err:
        job(ssh={"mountPath": path})
    assert err.value.field == "spec.ssh.mountPath"


def test_termination_grace_period_on_every_pod_and_never_below_the_log_drain():
    j = job(workers=2, terminationGracePeriodSeconds=600)
    assert dtj.render_worker(j, 1, 0)["spec"]["terminationGracePeriodSeconds"] == 600
    assert dtj.render_launcher(j, 0)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 600
    out = {"blob": {"accountURL": "https://a.blob.core.windows.net", "container": "out",
                    "auth": {"sasSecretRef": {"name": "s", "key": "k"}}}}
    shipped = dtj.render_worker(job(workers=1, output=out, terminationGracePeriodSeconds=5), 0, 0)
    drain = dtj.render_worker(job(workers=1, output=out), 0, 0)["spec"]["terminationGracePeriodSeconds"]
    assert shipped["spec"]["terminationGracePeriodSeconds"] == drain > 5
    assert "terminationGracePeriodSeconds" not in dtj.render_worker(job(workers=1), 0, 0)["spec"]


def test_a_launcher_that_runs_ranks_is_a_worker_too():
    """spec.mpirun.runLauncherAsWorker: first in the hostfile, a worker's GPUs, volumes and a
    DNS name of its own Service; (workers + 1) x slots ranks."""
    j = job(workers=2, gpusPerWorker=4, data={"dataStageRef": {"name": "imagenet"}},
            mpirun={"runLauncherAsWorker": True})
    assert (j.total_slots, j.total_gpus) == (12, 12)
    assert dtj.hostfile(j) == ("j1-launcher.j1-launcher.team-a.svc slots=4\n"
                               "j1-worker-0.j1.team-a.svc slots=4\nj1-worker-1.j1.team-a.svc slots=4\n")
    assert dtj.render_config_map(j)["data"]["hosts"].splitlines()[0] == "j1-launcher.j1-launcher.team-a.svc"
    launcher = dtj.render_launcher(j, 0, claim_name="imagenet-data")
    pod = launcher["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert (pod["hostname"], pod["subdomain"]) == ("j1-launcher", "j1-launcher")
    assert c["resources"] == dtj.render_worker(j, 0, 0)["spec"]["containers"][0]["resources"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"shm", "output", "data", "ssh", "mpi"} <= {v["name"] for v in pod["volumes"]}
    assert launcher["spec"]["template"]["metadata"]["labels"]["trainop.io/reads-datastage"] == "imagenet"
    assert "mpirun -np 12 " in c["command"][2]
    service = dtj.render_launcher_service(j)
    assert service["metadata"]["name"] == "j1-launcher" and service["spec"] == {
        "clusterIP": "None", "publishNotReadyAddresses": True,
        "selector": {"trainop.io/job-name": "j1", "trainop.io/role": "launcher"}}
    plain = dtj.render_launcher(job(workers=2, gpusPerWorker=4), 0)["spec"]["template"]["spec"]
    assert "hostname" not in plain and "nvidia.com/gpu" not in str(plain["containers"][0]["resources"])


@pytest.mark.parametrize("extra, field", [
    ({"mpirun": {"runLauncherAsWorker": True, "resources": {"requests": {"cpu": "1"}}}}, "spec.mpirun.resources"),
    ({"mpirun": {"runLauncherAsWorker": True}, "preflight": {"enabled": True}}, "spec.preflight.enabled"),
    ({"mpirun": {"runLauncherAsWorker": True}, "output": {"blob": {
        "accountURL": "https://a.blob.core.windows.net", "container": "out",
        "auth": {"sasSecretRef": {"name": "s", "key": "k"}}}}}, "spec.mpirun.runLauncherAsWorker"),
    ({"mpirun": {"runLauncherAsWorker": True}, "launcher": "torchrun"}, "spec.mpirun"),
])
def test_what_a_launcher_that_runs_ranks_cannot_have(extra, field):
    with pytest.raises(SpecError) as err:
        job(workers=2, gpusPerWorker=1, **extra)
    assert err.value.field == field, str(err.value)


def test_command_and_args_overrides():
    assert dtj.rank_command(job(command=["python3", "x.py"])) == ["python3", "x.py"]
    assert dtj.rank_command(job(command=["python3", "x.py"], args=["-v"])) == ["python3", "x.py", "-v"]
    assert dtj.rank_command(job(args=["--help"])) == ["python", "-m", "trainop_trainer", "--help"]
    assert dtj.trainer_args(job(data={"dataStageRef": {"name": "d"}}, launcher="torchrun",
                                training={"stepsPerEpoch": 5, "imageSize": 64, "compile": True})) == [
        "--framework", "pytorch", "--backend", "native", "--data-dir", "/data", "--batch-size", "64",
        "--epochs", "1", "--steps-per-epoch", "5", "--image-size", "64", "--precision", "fp32",
        "--compile", "--output-dir", "/output", "--metrics-file", "/output/metrics.jsonl"]


def test_torchrun_worker():
    j = job(launcher="torchrun", workers=3, gpusPerWorker=2)
    pod = dtj.render_worker(j, 2, attempt=0)
    (c,) = pod["spec"]["containers"]
    assert "readinessProbe" not in c and "ssh" not in {v["name"] for v in pod["spec"]["volumes"]}
    script = c["command"][2]
    assert 'for host in j1-worker-0.j1.team-a.svc; do' in script
    lines = script.strip().splitlines()
    assert lines[-1] == 'while :; do wait "$torchrun"; status=$?; kill -0 "$torchrun" 2>/dev/null || exit "$status"; done'
    assert "trap stop TERM" in lines  # the ranks get the SIGTERM, not torchrun (its 30 s SIGKILL)
    assert lines[lines.index("torchrun=$!") - 1] == (
        "torchrun --nnodes=3 --nproc-per-node=2 --rdzv-backend=c10d "
        "--rdzv-endpoint=j1-worker-0.j1.team-a.svc:29400 --rdzv-id=j1 --max-restarts=0 "
        "-m trainop_trainer --framework pytorch --backend native --synthetic --batch-size 64 "
        "--epochs 1 --precision fp32 --output-dir /output --metrics-file /output/metrics.jsonl &")
    custom = dtj.torchrun_script(job(launcher="torchrun", command=["python", "t.py"]))
    assert "--max-restarts=0 --no-python python t.py" in custom


def test_output_claim_and_log_shipper_parts():
    j = job(workers=2, output={"pvc": {"claimName": "results"}})
    worker = dtj.render_worker(j, 0, attempt=0)
    volumes = {v["name"]: v for v in worker["spec"]["volumes"]}
    assert volumes["output"] == {"name": "output", "persistentVolumeClaim": {"claimName": "results"}}
    launcher = dtj.render_launcher(j, attempt=0)["spec"]["template"]["spec"]
    # the log shipper wraps the launcher's command in its tee (render/logship.py owns the details)
    assert launcher["containers"][0]["command"][3] == "trainop-tee"
    assert launcher["containers"][0]["command"][-3:-1] == ["sh", "-c"]
    no_output = dtj.render_worker(job(), 0, attempt=0)["spec"]
    # the admin's limits.emptyDirSizeLimit caps it (the kubelet evicts past it: review L7)
    assert {v["name"]: v for v in no_output["volumes"]}["output"] == \
        {"name": "output", "emptyDir": {"sizeLimit": "20Gi"}}
    assert "initContainers" not in no_output
    uncapped = parse({"metadata": {"name": "j1", "namespace": "team-a"}, "spec": {}},
                     config.from_dict({"limits": {"emptyDirSizeLimit": None}}))
    assert {v["name"]: v for v in dtj.render_worker(uncapped, 0, attempt=0)["spec"]["volumes"]}["output"] == \
        {"name": "output", "emptyDir": {}}
    with pytest.raises(config.ConfigError, match=r"limits.emptyDirSizeLimit: '20 GB' is not a size"):
        config.from_dict({"limits": {"emptyDirSizeLimit": "20 GB"}})


def test_renderers_are_deterministic():
    j = job(workers=2, gpusPerWorker=1)
    assert dtj.render_worker(j, 0, 0) == dtj.render_worker(j, 0, 0)
    assert dtj.render_launcher(j, 0) == dtj.render_launcher(j, 0)


def test_no_pod_of_a_job_automounts_an_api_token():
    """Training code must hold no API credential: every pod opts out of the automounted token;
    only worker 0's log shipper gets one, projected into that container alone."""
    blob = job(workers=2, output=BLOB_OUTPUT)
    for j in (blob, job(workers=2), job(launcher="torchrun", workers=2, output=BLOB_OUTPUT),
              job(workers=2, output={"pvc": {"claimName": "results"}})):
        for spec in pod_specs(j):
            assert spec["automountServiceAccountToken"] is False
            for c in spec["containers"]:
                assert all(m["name"] != "trainop-api-token" for m in c.get("volumeMounts", [])), c["name"]
    worker0, worker1, launcher = pod_specs(blob)
    assert [v["name"] for v in worker0["volumes"] if "projected" in v] == ["trainop-api-token"]
    assert [m["name"] for m in worker0["initContainers"][0]["volumeMounts"]][-1] == "trainop-api-token"
    assert not any("projected" in v for v in worker1["volumes"] + launcher["volumes"])


def test_workload_identity_token_skips_the_training_container():
    wi = {"blob": {**BLOB_OUTPUT["blob"], "auth": {"workloadIdentity": True}}}
    j = parse({"metadata": {"name": "j1", "namespace": "team-a"},
               "spec": {"workers": 1, "output": wi}},
              config.from_dict({"logship": {"workloadIdentityServiceAccount": "wi"}}))
    worker = dtj.render_worker(j, 0, attempt=0)
    assert worker["metadata"]["annotations"] == {"azure.workload.identity/skip-containers": "worker"}
    assert worker["spec"]["containers"][0]["name"] == "worker"
    template = dtj.render_launcher(j, attempt=0)["spec"]["template"]
    assert template["metadata"]["annotations"] == {"azure.workload.identity/skip-containers": "launcher"}
    assert template["spec"]["containers"][0]["name"] == "launcher"
    assert "annotations" not in dtj.render_worker(job(workers=1, output=BLOB_OUTPUT), 0, attempt=0)["metadata"]


def test_the_job_policy_denies_link_local_egress_unless_the_admin_opens_it():
    """Issue 22 M9 (the rendering; tests/e2e/test_network_policy.py tries the connection)."""
    from trainop import config as config_
    from trainop import spec as spec_
    from trainop.render import dtj as dtj_
    body = {"apiVersion": "trainop.io/v1alpha1", "kind": "DistributedTrainingJob",
            "metadata": {"name": "a", "namespace": "ns", "uid": "u"},
            "spec": {"workers": 1, "gpusPerWorker": 1}}
    pol = dtj_.render_network_policy(spec_.parse(body, config_.from_dict(None)))["spec"]
    assert pol["policyTypes"] == ["Ingress", "Egress"]
    assert pol["egress"][2]["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16", "168.63.129.16/32"]}},
                                      {"ipBlock": {"cidr": "::/0", "except": ["fe80::/10"]}}]
    assert {p["port"] for p in pol["egress"][1]["ports"]} == {53} and "to" not in pol["egress"][1]
    opened = dtj_.render_network_policy(spec_.parse(body, config_.from_dict({"jobNetwork": {"deniedEgressCIDRs": []}})))
    assert opened["spec"]["policyTypes"] == ["Ingress"] and "egress" not in opened["spec"]
