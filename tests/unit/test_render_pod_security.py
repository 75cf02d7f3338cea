"""Every pod the operator renders, checked against the `restricted` Pod Security Standard.

`restricted_violations` is the profile's rules as written in
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (restricted includes
baseline), as a pure function of a pod spec: the fast check. A namespace labelled
pod-security.kubernetes.io/enforce=restricted on a real node is the slow one.
"""

from __future__ import annotations

import copy

import pytest

from trainop import config
from trainop.render import datastage, dtj
from trainop.spec import parse, parse_stage

# every worker gets the sidecar; the admin lets jobs upload as `wi`
CFG = config.from_dict({"logship": {"shipWorkerLogs": True}, "blob": {"allowedServiceAccounts": ["wi"]}})

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                   "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _options_violations(where: str, ctx: dict) -> list[str]:
    """Rules that hold for the pod's and each container's securityContext alike."""
    out = []
    if ctx.get("runAsUser") == 0:
        out.append(f"{where}.runAsUser: must not be 0")
    if (ctx.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{where}.windowsOptions.hostProcess: must be unset or false")
    selinux = ctx.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        out.append(f"{where}.seLinuxOptions: custom user, role or type")
    if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}.appArmorProfile: must not be Unconfined")
    return out


def restricted_violations(pod: dict) -> list[str]:
    """Each rule of `restricted` that the pod spec `pod` breaks; [] when it passes."""
    out = [f"{key}: must be unset or false" for key in ("hostNetwork", "hostPID", "hostIPC")
           if pod.get(key)]
    for volume in pod.get("volumes") or []:
        kind = next(k for k in volume if k != "name")
        if kind not in ALLOWED_VOLUMES:  # hostPath included
            out.append(f"volumes[{volume['name']}]: {kind} is not an allowed volume type")
    psc = pod.get("securityContext") or {}
    out += _options_violations("securityContext", psc)
    out += [f"securityContext.sysctls: {s['name']} is not a safe sysctl"
            for s in psc.get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    containers = [c for key in ("initContainers", "containers", "ephemeralContainers")
                  for c in pod.get(key) or []]
    for c in containers:
        where, sc = f"{c['name']}.securityContext", c.get("securityContext") or {}
        out += _options_violations(where, sc)
        if sc.get("privileged"):
            out.append(f"{where}.privileged: must be unset or false")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}.allowPrivilegeEscalation: must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}.capabilities.drop: must include ALL")
        if added := sorted(set(caps.get("add") or []) - {"NET_BIND_SERVICE"}):
            out.append(f"{where}.capabilities.add: only NET_BIND_SERVICE is allowed, not {added}")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{where}.runAsNonRoot: must be true (here or on the pod)")
        if sc.get("seccompProfile", {}).get("type", pod_seccomp) not in SECCOMP_OK:
            out.append(f"{where}.seccompProfile.type: must be RuntimeDefault or Localhost (here or on the pod)")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}.procMount: must be Default")
        out += [f"{c['name']}.ports[{p.get('name', p['containerPort'])}].hostPort: must be unset or 0"
                for p in c.get("ports") or [] if p.get("hostPort")]
    return out


def job(**spec):
    return parse({"metadata": {"name": "j1", "namespace": "team-a"}, "spec": spec}, CFG)


def pod_specs(j):
    out = [dtj.render_worker(j, i, attempt=0, claim_name="d-data" if j.data_stage else None)["spec"]
           for i in range(j.workers)]
    if j.launcher == "mpi":
        out.append(dtj.render_launcher(j, attempt=0)["spec"]["template"]["spec"])
    return out


SAS = {"sasSecretRef": {"name": "storage", "key": "sas"}}
JOBS = {
    "cpu-mpi": {"workers": 2},
    "gpu-intel": {"workers": 2, "gpusPerWorker": 4, "mpiImplementation": "Intel"},
    "infiniband": {"workers": 2, "gpusPerWorker": 8, "infiniband": True},
    "infiniband-preflight": {"workers": 2, "gpusPerWorker": 8, "infiniband": True, "launcher": "torchrun",
                             "preflight": {"enabled": True, "minBusBandwidthGBps": 100},
                             "output": {"blob": {"accountURL": "https://a.blob.core.windows.net",
                                                 "container": "results", "auth": {"sasSecretRef": {"name": "s", "key": "k"}}}}},
    "torchrun": {"launcher": "torchrun", "workers": 2, "gpusPerWorker": 1},
    "blob-output": {
        "workers": 2, "output": {"blob": {"accountURL": "https://a.blob.core.windows.net",
                                          "container": "results", "auth": SAS}}},
    "workload-identity": {"output": {"blob": {"accountURL": "https://a.blob.core.windows.net",
                                              "container": "results",
                                              "auth": {"workloadIdentity": True,
                                                       "serviceAccountName": "wi"}}}},
    "pvc-output-and-data": {"output": {"pvc": {"claimName": "results"}},
                            "data": {"dataStageRef": {"name": "d"}}},
    "custom-user": {"image": "mpioperator/mpi-pi", "command": ["/home/mpiuser/pi"],
                    "securityContext": {"runAsUser": 1000, "runAsGroup": 1000}},
}


@pytest.mark.parametrize("name", JOBS)
def test_every_job_pod_passes_restricted(name):
    specs = pod_specs(job(**JOBS[name]))
    assert specs and all(restricted_violations(s) == [] for s in specs), \
        [restricted_violations(s) for s in specs]
    if "blob" in JOBS[name].get("output", {}):
        assert all(s.get("initContainers") for s in specs)  # the sidecar was checked too


def stage(destination: dict):
    return parse_stage({
        "apiVersion": "trainop.io/v1alpha1", "kind": "DataStage",
        "metadata": {"name": "imagenet", "namespace": "team-a"},
        "spec": {"source": {"blob": {"accountURL": "https://a.blob.core.windows.net",
                                     "container": "imagenet", "auth": SAS}},
                 "destination": destination}})


def test_infiniband_breaks_restricted_only_by_what_the_admin_turns_on():
    """IPC_LOCK (infiniband.ipcLock) and a topology file from the node (hostPath) need a
    privileged namespace; a topology file inside the image does not (docs/security.md)."""
    pools = {"nodePools": {"nd": {"nodeSelector": {"kubernetes.azure.com/agentpool": "nd"}, "infiniband": True,
                                  "instanceType": "Standard_ND96isr_H100_v5"}},
             "defaultNodePools": {"cpu": None, "gpu": "nd", "infiniband": "nd"}}
    ib = {"metadata": {"name": "j1", "namespace": "team-a"},
          "spec": {"workers": 2, "gpusPerWorker": 8, "infiniband": True, "preflight": {"enabled": True}}}

    def violations(**sections):
        return restricted_violations(pod_specs(parse(ib, config.from_dict({**pools, **sections})))[0])

    assert violations(infiniband={"topologyFilesFrom": "image"}) == []
    assert any("hostPath" in v for v in violations())
    assert any("IPC_LOCK" in v for v in violations(infiniband={"ipcLock": True, "topologyFilesFrom": "image"}))


def test_copy_job_breaks_restricted_only_by_its_inline_nfs_volume():
    copy_job = datastage.copy_job(stage({"nfs": {"server": "10.1.2.3", "path": "/x"}}), "10.1.2.3", CFG)
    assert restricted_violations(copy_job["spec"]["template"]["spec"]) == [
        "volumes[share]: nfs is not an allowed volume type"]


def test_copy_job_into_an_existing_claim_passes_restricted():
    claim = stage({"volumeClaim": {"claimName": "shared-files"}})
    assert restricted_violations(datastage.copy_job(claim, None, CFG)["spec"]["template"]["spec"]) == []


def test_ganesha_nfs_server_breaks_restricted_only_by_what_open_by_handle_at_needs():
    """NFS-Ganesha (the default server) is no privileged pod and holds no root: it breaks the
    profile only by DAC_READ_SEARCH (open_by_handle_at needs it), the privilege escalation that
    lets its non-root binary take it as a file capability, and the seccomp profile, since
    containerd's RuntimeDefault refuses open_by_handle_at (docs/security.md). With a Localhost
    profile that allows it, the seccomp line goes."""
    violations = [
        "nfs-server.securityContext.allowPrivilegeEscalation: must be false",
        "nfs-server.securityContext.capabilities.add: only NET_BIND_SERVICE is allowed, not ['DAC_READ_SEARCH']"]
    _, statefulset = datastage.server_objects(stage({"provision": {"size": "1Gi"}}), CFG)
    assert restricted_violations(statefulset["spec"]["template"]["spec"]) == [
        *violations,
        "nfs-server.securityContext.seccompProfile.type: must be RuntimeDefault or Localhost (here or on the pod)"]
    local = config.from_dict({"datastage": {"nfsServerSeccompProfile": {"type": "Localhost", "localhostProfile": "g.json"}}})
    _, statefulset = datastage.server_objects(stage({"provision": {"size": "1Gi"}}), local)
    assert restricted_violations(statefulset["spec"]["template"]["spec"]) == violations


def test_kernel_nfs_server_is_privileged():
    """The kernel NFS server (datastage.server: kernel) needs privilege: only an admin's choice."""
    cfg = config.from_dict({"datastage": {"server": "kernel"}})
    _, statefulset = datastage.server_objects(stage({"provision": {"size": "1Gi"}}), cfg)
    violations = restricted_violations(statefulset["spec"]["template"]["spec"])
    assert "nfs-server.securityContext.privileged: must be unset or false" in violations


def test_the_check_catches_each_rule():
    good = pod_specs(job(workers=1))[0]
    assert restricted_violations(good) == []

    def broken(change) -> list[str]:
        pod = copy.deepcopy(good)
        change(pod, pod["containers"][0])
        return restricted_violations(pod)

    assert broken(lambda p, c: p.update(hostNetwork=True)) == ["hostNetwork: must be unset or false"]
    assert broken(lambda p, c: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}})) == [
        "volumes[h]: hostPath is not an allowed volume type"]
    assert broken(lambda p, c: c["securityContext"].update(privileged=True)) == [
        "worker.securityContext.privileged: must be unset or false"]
    assert broken(lambda p, c: c["securityContext"].pop("allowPrivilegeEscalation")) == [
        "worker.securityContext.allowPrivilegeEscalation: must be false"]
    assert broken(lambda p, c: c["securityContext"]["capabilities"].update(add=["IPC_LOCK"])) == [
        "worker.securityContext.capabilities.add: only NET_BIND_SERVICE is allowed, not ['IPC_LOCK']"]
    assert broken(lambda p, c: c["securityContext"]["capabilities"].update(add=["NET_BIND_SERVICE"])) == []
    assert broken(lambda p, c: c["securityContext"].pop("capabilities")) == [
        "worker.securityContext.capabilities.drop: must include ALL"]
    assert broken(lambda p, c: p["securityContext"].pop("runAsNonRoot")) == [
        "worker.securityContext.runAsNonRoot: must be true (here or on the pod)"]
    assert broken(lambda p, c: c["securityContext"].update(runAsUser=0)) == [
        "worker.securityContext.runAsUser: must not be 0"]
    assert broken(lambda p, c: p["securityContext"].pop("seccompProfile")) == [
        "worker.securityContext.seccompProfile.type: must be RuntimeDefault or Localhost (here or on the pod)"]
    assert broken(lambda p, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"})) == [
        "worker.securityContext.seccompProfile.type: must be RuntimeDefault or Localhost (here or on the pod)"]
    assert broken(lambda p, c: c["ports"][0].update(hostPort=2222)) == [
        "worker.ports[ssh].hostPort: must be unset or 0"]
    assert broken(lambda p, c: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}])) == [
        "securityContext.sysctls: kernel.msgmax is not a safe sysctl"]
