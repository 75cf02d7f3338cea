"""Runs the local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and KWOK as plain processes (no containers), with AKS-shaped simulated node pools.

The same class backs `trainop devcluster up|down|status` (processes detached, state in
~/.trainop/devcluster) and the test suite's session fixture (state in a temp folder).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trainop.devcluster import build, nodes, pki
from trainop.devcluster.pools import NodePool, default_pools

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
POD_CIDR = "10.244.0.1/16"
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]
# Besides containerd, kubelet and device plugins per node; kube-router = the NetworkPolicy controller.
REAL_COMPONENTS = ["coredns", "kube-proxy", "kube-router"]
SIM_STAGES = Path(__file__).resolve().parent / "sim-stages.yaml"


# An audit policy that records who wrote what (create, update, patch, delete), not the reads.
WRITES_ONLY = [{"level": "None", "verbs": ["get", "list", "watch"]}, {"level": "Metadata"}]


class ClusterError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as dead.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


# Looked up once in the parent: the forked child (preexec_fn) must not take the dynamic loader's
# locks, which another thread of the test process may have held at fork time.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """Linux prctl(PR_SET_PDEATHSIG, SIGKILL): a killed test run leaves no control plane behind."""
    _prctl(1, signal.SIGKILL)


@dataclass
class DevCluster:
    state_dir: Path
    pools: list[NodePool] = field(default_factory=default_pools)
    # False for `trainop devcluster up` (the cluster outlives the command); True for test sessions.
    die_with_parent: bool = False
    # Every request's metadata (who, user agent, verb, when) as JSON lines here: how
    # bench/control_plane.py counts one client's own requests.
    audit_log: Path | None = None
    # The audit policy's rules (Metadata for every request by default); e.g. WRITES_ONLY.
    audit_rules: list[dict] = field(default_factory=lambda: [{"level": "Metadata"}])
    # What `up(crds=True)` was refused, by CRD file (install_crds' answer).
    crd_errors: dict[str, str] = field(default_factory=dict, init=False)

    # ---- files ---------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "state.json"

    def log_file(self, component: str) -> Path:
        return self.state_dir / "logs" / f"{component}.log"

    def _state(self) -> dict:
        try:
            return json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return {}

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def running_pools(self) -> list[NodePool]:
        """The pools of the cluster that runs (recorded at `up`), else the ones asked for: `down`
        and `status` from a later command must see the real nodes whatever flags it got."""
        saved = self._state().get("pools")
        return [NodePool(**p) for p in saved] if saved else self.pools

    @property
    def real_nodes(self) -> list[nodes.RealNode]:
        return nodes.plan(self.running_pools, self.state_dir)

    def components(self) -> list[str]:
        """Process names in start order: the control plane, then what real nodes need."""
        if not self.real_nodes:
            return list(COMPONENTS)
        per_node = [name for node in self.real_nodes
                    for name in (f"containerd/{node.name}", f"kubelet/{node.name}",
                                 *nodes.device_plugin_args(node))]
        return [*COMPONENTS, *REAL_COMPONENTS, *per_node]

    def status(self) -> dict[str, bool]:
        pids = self._state().get("pids", {})
        return {name: bool(pids.get(name)) and _alive(pids[name]) for name in self.components()}

    def is_up(self) -> bool:
        return all(self.status().values()) and self._ready("/readyz")

    def up(self, timeout: float = 120.0, crds: bool = False, crds_dir: Path | None = None) -> float:
        """Start everything (building binaries first if needed); return seconds taken to start.
        With `crds`, trainop's CRDs (those of `crds_dir`, default this checkout's) are installed
        before the controller-manager starts (refusals in `crd_errors`, as install_crds returns
        them): its garbage collector then knows their kinds from its first discovery, where CRDs
        installed after it wait for its next one (up to 30 s, issue 29)."""
        if self.is_up():
            if crds:  # they may have changed since: applied again
                self.crd_errors = install_crds(self.kubeconfig, crds_dir)
            return 0.0
        self.down()
        bins = build.ensure_binaries()
        real = self.real_nodes
        if real:
            nodes.require_ipset()
            nodes.claim_host(self.state_dir, lambda other: DevCluster(Path(other)).is_up())
            nodes.sweep()
            nodes.setup_host_network(real)
        started = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        pki.write_pki(self.pki_dir, SERVICE_IP, (nodes.HOST_IP,) if real else ())
        ports = {name: _free_port() for name in ("etcd", "etcd-peer", "apiserver", "cm", "sched", "kwok")}
        self._write_kubeconfig(ports["apiserver"])
        self._save({"ports": ports, "pids": {}, "bin_dir": str(bins),
                    "pools": [dataclasses.asdict(p) for p in self.pools]})
        kinds: list[tuple[str, str]] = []
        for name in COMPONENTS:
            if name == "kube-controller-manager" and crds:
                self.crd_errors, kinds = apply_crds(self.kubeconfig, crds_dir)
            self.start_component(name, timeout)
        wait_for_garbage_collector(self.kubeconfig, kinds)
        self._create_nodes()
        if real:
            self._start_real_nodes(real, bins, timeout)
        self._wait(self._nodes_ready, timeout, "nodes Ready")
        self._wait(self._default_service_account, timeout, "the default ServiceAccount")
        return time.monotonic() - started

    # ---- one component at a time: what bench/chaos.py and tests/cluster/test_chaos.py do to it --
    def start_component(self, name: str, timeout: float = 120.0) -> None:
        """Start control-plane component `name` with the ports and binaries recorded at `up` (so
        a restarted etcd finds its data and clients their endpoints); wait until etcd takes
        connections or the API server is ready."""
        state = self._state()
        ports, bins = state["ports"], Path(state["bin_dir"])
        self._spawn(name, [str(bins / name), *self._args(name, ports, bins)])
        if name == "etcd":
            self._wait(lambda: self._port_open(ports["etcd"]), timeout, "etcd")
        if name == "kube-apiserver":
            self._wait(lambda: self._ready("/readyz"), timeout, "kube-apiserver /readyz")

    def stop_component(self, name: str, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Send `sig` to component `name` (its process group) and wait until it has exited."""
        pid = self._state()["pids"][name]
        os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} (pid {pid}) outlived signal {sig} by {timeout:.0f}s")
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)

    def signal_component(self, name: str, sig: int) -> None:
        """Send `sig` to component `name` without waiting: SIGSTOP freezes it, SIGCONT resumes."""
        os.killpg(self._state()["pids"][name], sig)

    def _audit_args(self) -> list[str]:
        if self.audit_log is None:
            return []
        policy = self.state_dir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                                          "omitStages": ["RequestReceived"],
                                          "rules": self.audit_rules}))
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json", "--audit-log-maxsize=0"]

    def _save(self, state: dict) -> None:
        self._state_file.write_text(json.dumps(state, indent=1))

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        log = self.log_file(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.state_dir,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        state = self._state()
        state["pids"][name] = proc.pid
        self._save(state)

    def _start_real_nodes(self, real: list[nodes.RealNode], bins: Path, timeout: float) -> None:
        """CoreDNS and kube-proxy for the cluster, then containerd, kubelet and device plugins per
        node (images are loaded into each node's containerd before its kubelet starts), then the
        NetworkPolicy controller (it reads its node's address at start)."""
        from trainop.devcluster import images

        self._kubectl_apply(nodes.dns_objects())
        (self.state_dir / "Corefile").write_text(nodes.corefile(self.kubeconfig))
        self._spawn("coredns", [str(build.ensure_addon("coredns") / "coredns"), "-conf",
                                str(self.state_dir / "Corefile")])
        proxy_ports = (_free_port(), _free_port())
        (self.state_dir / "kube-proxy.yaml").write_text(yaml.safe_dump(
            nodes.kube_proxy_config(self.kubeconfig, real[0].name, *proxy_ports)))
        self._spawn("kube-proxy", [str(bins / "kube-proxy"), f"--config={self.state_dir / 'kube-proxy.yaml'}"])
        server = f"https://127.0.0.1:{self._state()['ports']['apiserver']}"
        build.ensure_addon("cni")
        for node in real:
            nodes.write_node_files(node, self.pki_dir, server, images.sandbox_image(),
                                   _free_port(), _free_port())
            self._start_node(node, bins, timeout, load_images=True)
        self._wait(lambda: self._devices_advertised(real), timeout, "GPUs advertised on the real nodes")
        self._spawn("kube-router", [str(build.ensure_addon("kube-router") / "kube-router"),
                                    *nodes.network_policy_args(self.kubeconfig, real[0], SERVICE_CIDR)])
        self._wait(nodes.network_policy_armed, timeout, "kube-router's network policy chains")

    def _start_node(self, node: nodes.RealNode, bins: Path, timeout: float, load_images: bool) -> None:
        """containerd, the kubelet and the device plugins of one real node (its files written)."""
        from trainop.devcluster import images

        self._spawn(f"containerd/{node.name}", ["containerd", *nodes.containerd_args(node)])
        # (a connection, not the file: a killed containerd leaves its socket file behind)
        self._wait(lambda: _listening(node.containerd_socket), timeout, f"containerd of {node.name}")
        if load_images:
            wanted = nodes.node_images(node.pool)
            images.load(str(node.containerd_socket), wanted)
            images.prune(str(node.containerd_socket),
                         {ref for name in wanted for ref in images.containerd_refs(name)})
        nodes.forget_device_checkpoint()
        self._spawn(f"kubelet/{node.name}", [str(bins / "kubelet"), *nodes.kubelet_args(node)])
        self._wait(lambda: self._get(f"/api/v1/nodes/{node.name}")[0] == 200, timeout,
                   f"{node.name} registered")
        plugins = nodes.device_plugin_args(node)
        if plugins:  # they register through the kubelet's plugin watcher folder
            self._wait((node.kubelet_root / "plugins_registry").is_dir, timeout,
                       f"the plugin registration folder of {node.name}'s kubelet")
        for name, args in plugins.items():
            self._spawn(name, [str(bins / "gpu-device-plugin"), *args])

    def kill_node(self, node_name: str) -> None:
        """A real node dies as a VM that loses power would: its network goes silent first (its
        pods' bridge down), then its kubelet, containerd and device plugins are SIGKILLed, then
        every container process of the node and its runc shims. Its Node object and pods stay
        in the API, as they say last; `revive_node` starts it again.

        Silent, because a powered-off VM sends nothing: its peers' connections to it hang until
        a timeout or the operator's restart, as on a cloud. Killed processes on a live kernel
        would close their sockets instead, and a launcher on another node would see its remote
        daemons' connections reset and fail at once, before the node lifecycle controller
        judges the node lost (what the operator reads): a failure of the job, not of its node.
        One run of the elastic e2e test (2026-12-07) failed so, with the launcher on the node
        that lived."""
        node = next(n for n in self.real_nodes if n.name == node_name)
        nodes.cut_node_network(node)
        state = self._state()
        for name in [n for n in self.components() if n.endswith(f"/{node.name}")]:
            pid = state["pids"].pop(name, None)  # dead on purpose: no waiting fails for it
            if pid and _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        self._save(state)
        nodes.kill_node_processes(node)

    def revive_node(self, node_name: str, timeout: float = 120.0) -> None:
        """A node killed by `kill_node` boots again: its containerd (images kept), kubelet and
        device plugins start with the state it left; returns once the node is Ready again."""
        node = next(n for n in self.real_nodes if n.name == node_name)
        nodes.restore_node_network(node)
        self._start_node(node, Path(self._state()["bin_dir"]), timeout, load_images=False)
        self._wait(lambda: self._node_ready(node.name), timeout, f"{node.name} Ready again")

    def _node_ready(self, name: str) -> bool:
        code, body = self._get(f"/api/v1/nodes/{name}")
        return code == 200 and any(c.get("type") == "Ready" and c.get("status") == "True"
                                   for c in json.loads(body).get("status", {}).get("conditions") or [])

    def kill_container(self, node_name: str, container_id: str) -> None:
        """SIGKILL one container of a real node from the host, as the kernel's OOM killer would."""
        node = next(n for n in self.real_nodes if n.name == node_name)
        subprocess.run(["ctr", "--address", str(node.containerd_socket), "-n", "k8s.io", "tasks", "kill",
                        "-s", "SIGKILL", container_id.removeprefix("containerd://")], check=True,
                       capture_output=True)

    def _devices_advertised(self, real: list[nodes.RealNode]) -> bool:
        code, body = self._get("/api/v1/nodes")
        if code != 200:
            return False
        allocatable = {n["metadata"]["name"]: n.get("status", {}).get("allocatable", {})
                       for n in json.loads(body)["items"]}
        return all(str(allocatable.get(node.name, {}).get(resource)) == str(count)
                   for node in real for resource, count in node.pool.devices().items())

    def down(self) -> None:
        pids = self._state().get("pids", {})
        real = self.real_nodes
        for name in reversed(self.components()):
            pid = pids.get(name)
            if pid and _alive(pid):
                try:
                    os.killpg(pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        # A throwaway cluster: a short grace, then SIGKILL (the API server would drain watches for a minute).
        deadline = time.monotonic() + 3
        for name in reversed(self.components()):
            pid = pids.get(name)
            while pid and _alive(pid) and time.monotonic() < deadline:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                time.sleep(0.1)
            if pid and _alive(pid):
                os.killpg(pid, signal.SIGKILL)
        if real:
            self._remove_real_nodes(real, pids.get("kube-proxy") is not None)
        if self._state_file.exists():
            self._state_file.unlink()
        # etcd data is thrown away: every `up` is a clean cluster, like a fresh kind cluster.
        shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)

    def _remove_real_nodes(self, real: list[nodes.RealNode], proxy_ran: bool) -> None:
        """Everything real nodes made: pods' processes and their runc shims, mounts, network
        namespaces, veths, bridges, iptables chains (kube-proxy's own cleanup mode; kube-router's
        chains and ipsets by name) and cgroups. Nothing while another live cluster owns the
        host: the bridges, the host address and the /trainop/<node> cgroups have the same names
        in every cluster, and this one never started nodes then (claim_host refused it)."""
        if nodes.other_owner(self.state_dir, lambda other: DevCluster(Path(other)).is_up()):
            return
        for node in real:
            nodes.kill_node_processes(node)
        nodes.remove_cni_netns()
        nodes.remove_state([node.state_dir for node in real])
        bins = Path(self._state().get("bin_dir") or build.bin_dir())
        if proxy_ran and (bins / "kube-proxy").exists():
            subprocess.run([str(bins / "kube-proxy"), "--cleanup"], capture_output=True)
        nodes.teardown_host_network()
        nodes.remove_cgroups()
        nodes.release_host(self.state_dir)

    # ---- process arguments ---------------------------------------------------------------
    def _args(self, name: str, ports: dict, bins: Path) -> list[str]:
        p = self.pki_dir
        kubeconfig = str(self.kubeconfig)
        if name == "etcd":
            return [
                "--name=trainop-dev", f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-cluster=trainop-dev=http://127.0.0.1:{ports['etcd-peer']}",
                # A throwaway dev cluster: skip fsync, which dominates etcd's latency on small disks.
                "--unsafe-no-fsync", "--quota-backend-bytes=2147483648", "--log-level=warn",
            ]
        if name == "kube-apiserver":
            return [
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                f"--secure-port={ports['apiserver']}",
                f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC", "--allow-privileged=true",
                "--enable-priority-and-fairness=false", "--v=1",
                *self._real_node_apiserver_args(), *self._audit_args(),
            ]
        if name == "kube-controller-manager":
            return [
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false",
                "--bind-address=127.0.0.1", f"--secure-port={ports['cm']}",
                f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
                f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
                "--use-service-account-credentials=false", "--controllers=*",
                # React quickly: tests wait on garbage collection, quota recount and job status.
                "--concurrent-gc-syncs=10", "--resource-quota-sync-period=10s", "--v=1",
                *self._node_lifecycle_args(),
            ]
        if name == "kube-scheduler":
            return [
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false",
                "--bind-address=127.0.0.1", f"--secure-port={ports['sched']}", "--v=1",
            ]
        if name == "kwok":
            stages = sorted((bins / "stages").glob("*.yaml")) + [SIM_STAGES]
            return [
                f"--kubeconfig={kubeconfig}", "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--cidr={POD_CIDR}", "--node-ip=127.0.0.1", f"--node-port={ports['kwok']}",
                f"--server-address=127.0.0.1:{ports['kwok']}",
                f"--node-lease-duration-seconds={nodes.LEASE_SECONDS if self.real_nodes else 40}",
                *[f"--config={s}" for s in stages],
            ]
        raise ValueError(name)

    def _node_lifecycle_args(self) -> list[str]:
        """With real nodes, a node that dies is judged lost after NODE_GRACE_SECONDS, not the
        default 50 s, so tests of a lost node stay short; every node renews its Lease four
        times within it (a quarter of nodes.LEASE_SECONDS, the kubelet's and KWOK's rule)."""
        return [f"--node-monitor-grace-period={nodes.NODE_GRACE_SECONDS}s"] if self.real_nodes else []

    def _real_node_apiserver_args(self) -> list[str]:
        p = self.pki_dir
        if not self.real_nodes:
            return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"]
        # Pods reach the API through the `kubernetes` Service, whose endpoint is the advertised
        # address: the host address on the loopback interface. The API server calls kubelets (logs,
        # exec) at their InternalIP (that same host address, each kubelet on its own port) as the
        # cluster admin.
        return ["--bind-address=0.0.0.0", f"--advertise-address={nodes.HOST_IP}",
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={p / 'admin.crt'}", f"--kubelet-client-key={p / 'admin.key'}"]

    def _write_kubeconfig(self, port: int) -> None:
        p = self.pki_dir
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "trainop-dev",
            "clusters": [{"name": "trainop-dev", "cluster": {
                "server": f"https://127.0.0.1:{port}", "certificate-authority": str(p / "ca.crt")}}],
            "users": [{"name": "trainop-admin", "user": {
                "client-certificate": str(p / "admin.crt"), "client-key": str(p / "admin.key")}}],
            "contexts": [{"name": "trainop-dev", "context": {
                "cluster": "trainop-dev", "user": "trainop-admin", "namespace": "default"}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    # ---- readiness -----------------------------------------------------------------------
    def _port_open(self, port: int) -> bool:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            return sock.connect_ex(("127.0.0.1", port)) == 0

    def _get(self, path: str) -> tuple[int, bytes]:
        port = self._state().get("ports", {}).get("apiserver")
        if not port:
            return 0, b""
        ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=ctx, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except OSError:
            return 0, b""

    def _ready(self, path: str) -> bool:
        return self._get(path)[0] == 200

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            dead = [n for n, ok in self.status().items() if not ok and n in self._state().get("pids", {})]
            if dead:
                tail = self.log_file(dead[0]).read_text(errors="replace")[-3000:]
                raise ClusterError(f"{dead[0]} exited while waiting for {what}; its log ends:\n{tail}")
            time.sleep(0.2)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what} (logs in {self.state_dir / 'logs'})")

    def _kubectl_apply(self, docs: list[dict]) -> None:
        from trainop.devcluster import kubectl

        kubectl.run(self.kubeconfig, "apply", "--server-side", "-f", "-",
                    input=yaml.safe_dump_all(docs), check=True)

    def _create_nodes(self) -> None:
        from trainop.devcluster import kubectl

        nodes = [node for pool in self.pools for node in pool.nodes()]
        # Node status is part of the object on create (as a kubelet registers it), so capacity and
        # allocatable arrive in one call; `kubectl create` keeps it, `apply` would drop it.
        existing = set(kubectl.run(self.kubeconfig, "get", "nodes", "-o", "name", check=True).stdout.split())
        todo = [n for n in nodes if f"node/{n['metadata']['name']}" not in existing]
        if todo:
            kubectl.run(self.kubeconfig, "create", "-f", "-", input=yaml.safe_dump_all(todo), check=True)

    def _nodes_ready(self) -> bool:
        code, body = self._get("/api/v1/nodes")
        if code != 200:
            return False
        items = json.loads(body)["items"]
        ready = [n for n in items if any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in n.get("status", {}).get("conditions", []))]
        return len(ready) >= sum(p.count for p in self.pools)

    def _default_service_account(self) -> bool:
        return self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200


def install_crds(kubeconfig: Path, crds_dir: Path | None = None) -> dict[str, str]:
    """Apply every CRD in crds/ (the single source the chart also uses) and wait until served,
    and until the garbage collector knows their kinds (see wait_for_garbage_collector).

    Returns {file name: error} for the CRDs the API server refused (empty when all installed), so
    one broken definition is reported by name instead of hiding the others.
    """
    errors, kinds = apply_crds(kubeconfig, crds_dir)
    wait_for_garbage_collector(kubeconfig, kinds)
    return errors


def apply_crds(kubeconfig: Path, crds_dir: Path | None = None) \
        -> tuple[dict[str, str], list[tuple[str, str]]]:
    """install_crds without the garbage collector's wait: (refusals by file, the kinds served
    as (apiVersion, kind))."""
    from trainop.devcluster import kubectl
    from trainop.paths import CRDS_DIR

    errors, kinds = {}, []
    for path in sorted((crds_dir or CRDS_DIR).glob("*.yaml")):
        applied = kubectl.run(kubeconfig, "apply", "--server-side", "--force-conflicts", "-f", str(path))
        if applied.returncode == 0:
            crd = yaml.safe_load(path.read_text())
            name = crd["metadata"]["name"]
            waited = kubectl.run(kubeconfig, "wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
            if waited.returncode == 0:
                served = next(v["name"] for v in crd["spec"]["versions"] if v.get("served"))
                kinds.append((f"{crd['spec']['group']}/{served}", crd["spec"]["names"]["kind"]))
                continue
            applied = waited
        errors[path.name] = applied.stderr.strip()
    return errors, kinds


def wait_for_garbage_collector(kubeconfig: Path, kinds: list[tuple[str, str]],
                               timeout: float = 120.0) -> None:
    """The controller-manager's garbage collector learns of new CRDs at its next discovery sync
    (every 30 s, not configurable); until then it leaves the dependents of a deleted custom
    resource alone, so a test that deletes one right after `up` would wait on a race. For each
    kind, a ConfigMap owned by a custom resource that does not exist is collected exactly when
    the collector can resolve that kind."""
    from trainop.devcluster import kubectl

    canaries = []
    for api_version, kind in kinds:
        name = f"gc-canary-{kind.lower()}-{uuid.uuid4().hex[:8]}"
        owner = {"apiVersion": api_version, "kind": kind, "name": "gone", "uid": str(uuid.uuid4())}
        kubectl.run(kubeconfig, "create", "-f", "-", check=True, input=json.dumps({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "default", "ownerReferences": [owner]}}))
        canaries.append(f"configmap/{name}")
    if canaries:
        waited = kubectl.run(kubeconfig, "wait", "--for=delete", f"--timeout={int(timeout)}s",
                             "-n", "default", *canaries)
        if waited.returncode != 0:
            raise ClusterError(f"the garbage collector did not learn {kinds} within {timeout:.0f}s: "
                               f"{waited.stderr.strip()}")
