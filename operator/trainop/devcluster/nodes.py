"""Real nodes for the dev cluster: real kubelets on containerd + runc, CNI networking, kube-proxy,
CoreDNS and NetworkPolicy enforcement (kube-router's network policy controller), so the pods
trainop makes actually run (on the CPU) instead of being simulated.

Layout on the host (all in the host's network namespace, as on a kind node):
  HOST_IP        an address on the loopback interface (this kernel has no dummy interfaces):
                 where pods reach the API server, CoreDNS (through the kube-dns Service) and any
                 test service on the host (Azurite); also every node's InternalIP (so every
                 pod's status.hostIP), since the nodes share this one host: see kubelet_args
  trainop<i>     node i's bridge, gateway 10.245.<i>.1; its pods get 10.245.<i>.0/24 from
                 host-local IPAM
  TRAINOP-FWD    iptables chains at the top of FORWARD in the mangle table (so before any filter
                 rule, the policy controller's ACCEPTs included): pod traffic may go to pods and the
                 host only, never off this machine (the workplace's network rule); and in the
                 filter table, accepting pod-to-pod traffic that no network policy decided on
  kube-router    its network policy controller only, one for the host (see network_policy_args):
                 KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-* chains and KUBE-SRC-*/KUBE-DST-* ipsets
Per node: its own containerd (root in the cache, so imported images survive a restart), its own
kubelet (root-dir, cgroup root /trainop/<node>, port) and the stand-in device plugins that
advertise the pool's `nvidia.com/gpu` and `rdma/ib` the way NVIDIA's and Mellanox's plugins do.
One kube-proxy (iptables mode) serves every node: they share one network namespace.

Only one dev cluster on a machine may run real nodes at a time (they share these names):
HOST_LOCK records which one does, and `up` refuses while its owner is alive.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainop.devcluster import build, pki
from trainop.devcluster.pools import NodePool
from trainop.paths import cache_dir

POD_NETWORK = "10.245.0.0/16"
HOST_IP = "10.245.255.1"  # on `lo`; also the API server's advertised address
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
FORWARD_CHAIN = "TRAINOP-FWD"
# ipsets the network policy controller makes (KUBE-SRC-/KUBE-DST- per policy; TMP- only while it
# swaps a set in, left behind if it dies mid-restore). Nothing else on these machines uses ipset.
IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-", "TMP-", "inet6:KUBE-", "inet6:TMP-")
HOST_LOCK = Path("/run/trainop-devcluster-real-nodes.json")
CGROUP_ROOT = "trainop"
# The kubelet's device manager keeps its checkpoint in this fixed folder, whatever --root-dir
# says, so kubelets on one host share it: a node would report the other's resources (at 0).
DEVICE_CHECKPOINT = Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")
# Extended resources advertised by the stand-in device plugin, and the variable its Allocate sets
# (NVIDIA's plugin sets NVIDIA_VISIBLE_DEVICES; the RDMA plugin none).
DEVICE_ENV = {"nvidia.com/gpu": "NVIDIA_VISIBLE_DEVICES", "rdma/ib": ""}
# Labels the kubelet sets itself or refuses through --node-labels.
KUBELET_OWNED = {"kubernetes.io/hostname", "kubernetes.io/os", "kubernetes.io/arch"}


class NodeSetupError(RuntimeError):
    pass


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


@dataclass(frozen=True)
class RealNode:
    """One real node: `index` picks its bridge and pod subnet."""
    name: str
    index: int
    pool: NodePool
    state_dir: Path  # <cluster state>/n<index>

    @property
    def bridge(self) -> str:
        return f"trainop{self.index}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"10.245.{self.index}.0/24")

    @property
    def ip(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def containerd_socket(self) -> Path:
        return self.state_dir / "containerd" / "containerd.sock"

    @property
    def containerd_root(self) -> Path:
        # Persistent: images imported once stay (the trainer image is gigabytes).
        return cache_dir() / "devcluster" / "containerd" / self.name

    @property
    def kubelet_root(self) -> Path:
        return self.state_dir / "kubelet"

    def labels(self) -> dict[str, str]:
        labels = dict(self.pool.node(self.index_in_pool())["metadata"]["labels"])
        labels.pop("type", None)  # "kwok"
        return {k: v for k, v in labels.items() if k not in KUBELET_OWNED}

    def index_in_pool(self) -> int:
        return self.pool.node_names().index(self.name)


def node_images(pool: NodePool) -> list[str]:
    """Images (devcluster/images.py names) a node of the pool gets: the sandbox and the operator's
    (log-shipper sidecar, stager) everywhere; the PyTorch trainer and the tests' custom MPI
    image on GPU pools, where jobs run;
    the NFS server on the CPU pool. (A CPU-only job runs on the CPU pool: load the trainer there
    with images.load() when you need one; imports are gigabytes, so not by default.)"""
    return ["pause", "operator", *(["trainer-pytorch", "mpi-pi"] if pool.gpus else ["nfs-server"])]


def plan(pools: list[NodePool], cluster_state: Path) -> list[RealNode]:
    nodes = []
    for pool in (p for p in pools if p.real):
        for name in pool.node_names():
            # Short folder names: unix sockets (containerd's, the device plugins') live below.
            nodes.append(RealNode(name, len(nodes), pool, cluster_state / f"n{len(nodes)}"))
    if len(nodes) > 250:
        raise ValueError("at most 250 real nodes (one /24 of 10.245.0.0/16 each)")
    return nodes


# ---- host network -------------------------------------------------------------------------------
def _link_exists(name: str) -> bool:
    return sh("ip", "link", "show", name, check=False).returncode == 0


def setup_host_network(nodes: list[RealNode]) -> None:
    for key, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
        Path("/proc/sys", key).write_text(value)
    if HOST_IP not in sh("ip", "-o", "addr", "show", "dev", "lo").stdout:
        sh("ip", "addr", "add", f"{HOST_IP}/32", "dev", "lo")
    for node in nodes:
        if not _link_exists(node.bridge):
            sh("ip", "link", "add", node.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{node.ip}/{node.subnet.prefixlen}", "dev", node.bridge)
        sh("ip", "link", "set", node.bridge, "up")
    # The machine boundary lives in mangle's FORWARD, which runs before filter's: kube-router
    # keeps its own jump first in filter's FORWARD and ACCEPTs there whatever the policies admit,
    # egress off the machine included (no egress policy = all egress admitted).
    if sh("iptables", "-t", "mangle", "-n", "-L", FORWARD_CHAIN, check=False).returncode != 0:
        sh("iptables", "-t", "mangle", "-N", FORWARD_CHAIN)
        sh("iptables", "-t", "mangle", "-A", FORWARD_CHAIN, "-s", POD_NETWORK, "-d", POD_NETWORK, "-j", "RETURN")
        sh("iptables", "-t", "mangle", "-A", FORWARD_CHAIN, "-s", POD_NETWORK, "-j", "DROP")
        sh("iptables", "-t", "mangle", "-A", FORWARD_CHAIN, "-d", POD_NETWORK, "-j", "DROP")
        sh("iptables", "-t", "mangle", "-I", "FORWARD", "1", "-j", FORWARD_CHAIN)
    # Pod-to-pod traffic the policy controller neither rejected nor accepted (pods it has not seen
    # yet) is accepted here, whatever FORWARD's policy (podman's and Docker's rules may drop).
    if sh("iptables", "-n", "-L", FORWARD_CHAIN, check=False).returncode != 0:
        sh("iptables", "-N", FORWARD_CHAIN)
        sh("iptables", "-A", FORWARD_CHAIN, "-s", POD_NETWORK, "-d", POD_NETWORK, "-j", "ACCEPT")
        sh("iptables", "-A", FORWARD_CHAIN, "-s", POD_NETWORK, "-j", "DROP")
        sh("iptables", "-A", FORWARD_CHAIN, "-d", POD_NETWORK, "-j", "DROP")
        sh("iptables", "-I", "FORWARD", "1", "-j", FORWARD_CHAIN)


# A dead node's subnet is dropped here rather than sent to the host's default route (off the
# machine, where something might answer). Its metric loses to the bridge's own route, so a
# leftover one (a test that died before revive_node) harms nothing.
SILENT_METRIC = "4242"


def cut_node_network(node: RealNode) -> None:
    """The node's pods fall silent (kill_node): with their bridge down, nothing they send
    leaves and nothing reaches them, not even the resets of their processes' closing sockets."""
    sh("ip", "route", "replace", "blackhole", str(node.subnet), "metric", SILENT_METRIC)
    sh("ip", "link", "set", node.bridge, "down")


def restore_node_network(node: RealNode) -> None:
    sh("ip", "link", "set", node.bridge, "up")
    sh("ip", "route", "del", "blackhole", str(node.subnet), "metric", SILENT_METRIC, check=False)


def teardown_host_network() -> None:
    """Remove every interface, netns and chain real nodes make (also after a crash)."""
    links = json.loads(sh("ip", "-j", "link", "show").stdout or "[]")
    ours = {link["ifname"] for link in links if link["ifname"].startswith("trainop")}
    for link in links:  # pod veths whose pod is gone but whose netns survived a crash
        if link.get("master") in ours and link["ifname"] not in ours:
            sh("ip", "link", "del", link["ifname"], check=False)
    for name in sorted(ours):
        sh("ip", "link", "del", name, check=False)
    for dst in _silent_routes():
        sh("ip", "route", "del", "blackhole", dst, "metric", SILENT_METRIC, check=False)
    sh("ip", "addr", "del", f"{HOST_IP}/32", "dev", "lo", check=False)
    remove_chains()
    remove_ipsets()  # after the chains: a set still referenced by a rule cannot be destroyed


def _silent_routes() -> list[str]:
    """The destinations of cut_node_network's blackhole routes still in the table."""
    routes = json.loads(sh("ip", "-j", "route", "show", "type", "blackhole").stdout or "[]")
    return [r["dst"] for r in routes if str(r.get("metric")) == SILENT_METRIC]


def _ipsets() -> list[str]:
    if shutil.which("ipset") is None:
        return []
    return [name for name in sh("ipset", "list", "-n", check=False).stdout.split() if name.startswith(IPSET_PREFIXES)]


def remove_ipsets() -> None:
    """Destroy the network policy controller's ipsets (it has no working cleanup mode of its own:
    v2.1.0's --cleanup-config builds an empty controller, which removes nothing)."""
    for name in _ipsets():
        sh("ipset", "destroy", name, check=False)


def remove_chains(prefixes: tuple[str, ...] = ("KUBE-", "TRAINOP-")) -> None:
    """Delete our chain and those the kubelet leaves (KUBE-FIREWALL, hooked into INPUT and OUTPUT,
    and its canaries; kube-proxy's own go with `kube-proxy --cleanup`), with every jump to them."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = sh(tool, "-t", table, "-S", check=False).stdout.splitlines()
            ours = [line.split()[1] for line in rules if line.startswith("-N ") and line.split()[1].startswith(prefixes)]
            for line in rules:
                words = shlex.split(line)
                if words[0] == "-A" and "-j" in words and words[words.index("-j") + 1] in ours \
                        and words[1] not in ours:
                    sh(tool, "-t", table, "-D", *words[1:], check=False)
            for chain in ours:
                sh(tool, "-t", table, "-F", chain, check=False)
            for chain in ours:
                sh(tool, "-t", table, "-X", chain, check=False)


# ---- cgroups and mounts ---------------------------------------------------------------------------
def _cgroup_hierarchies() -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and (p / "cgroup.procs").exists()] \
        if root.is_dir() else []


def make_cgroup_root(node: RealNode) -> None:
    """The kubelet's cgroupRoot must exist in every hierarchy; a new cpuset cgroup starts with no
    CPUs or memory nodes, so each level inherits its parent's (as libcontainer does)."""
    for hierarchy in _cgroup_hierarchies():
        parent = hierarchy
        for part in (CGROUP_ROOT, node.name):
            path = parent / part
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (path / name).exists() and not (path / name).read_text().strip():
                    (path / name).write_text((parent / name).read_text())
            parent = path


def kill_cgroup_processes() -> None:
    """SIGKILL whatever still runs in a /trainop cgroup (pods of a crashed earlier cluster)."""
    for hierarchy in _cgroup_hierarchies():
        for procs in (hierarchy / CGROUP_ROOT).rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)


def sweep() -> None:
    """Before `up` takes the host over: remove what an earlier real-node cluster that died
    without `down` (a killed test session) left behind."""
    kill_cgroup_processes()
    remove_cni_netns()
    teardown_host_network()
    remove_cgroups()


def remove_cgroups() -> None:
    """rmdir every cgroup under /trainop, deepest first (only empty ones can go: run last)."""
    for hierarchy in _cgroup_hierarchies():
        top = hierarchy / CGROUP_ROOT
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def kill_node_processes(node: RealNode) -> None:
    """SIGKILL every container process of the node (its cgroup tree) and its runc shims, which
    outlive containerd by design (they are reparented, so process groups do not reach them)."""
    pids = set()
    for hierarchy in _cgroup_hierarchies():
        for procs in (hierarchy / CGROUP_ROOT / node.name).rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in procs.read_text().split()}
    socket = str(node.containerd_socket)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if argv[0].endswith(b"containerd-shim-runc-v2") and socket.encode() in argv:
                    pids.add(int(proc.name))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def unmount_under(folder: Path) -> None:
    """Unmount everything the kubelet and containerd mounted below folder (deepest first)."""
    prefix = str(folder.resolve()) + "/"
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix):
            mounts.append(point)
    for point in sorted(set(mounts), key=len, reverse=True):
        sh("umount", "-l", point, check=False)


def remove_cni_netns() -> None:
    """containerd keeps pod network namespaces at /var/run/netns/cni-*: unmount the ones left."""
    folder = Path("/var/run/netns")
    for path in folder.glob("cni-*") if folder.is_dir() else []:
        sh("umount", "-l", str(path), check=False)
        with contextlib.suppress(OSError):
            path.unlink()


# ---- configuration files ------------------------------------------------------------------------
def containerd_config(node: RealNode, sandbox_image: str) -> str:
    cni_bin = build.addon_dir("cni")
    state = node.state_dir / "containerd"
    return f"""version = 2
root = "{node.containerd_root}"
state = "{state / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{node.containerd_socket}"
[ttrpc]
  address = "{state / 'ttrpc.sock'}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{state / 'opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  # No registry is reachable: the pause image is built locally (devcluster/images.py).
  sandbox_image = "{sandbox_image}"
  # This VM refuses lowering oom_score_adj; without this every sandbox fails to start.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{node.state_dir / 'cni'}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{state / 'runc'}"
"""


def cni_config(node: RealNode) -> dict:
    return {
        "cniVersion": "1.0.0", "name": "trainop",
        "plugins": [
            {"type": "bridge", "bridge": node.bridge, "isGateway": True, "hairpinMode": True,
             # Never masquerade: pod traffic stays on this machine (TRAINOP-FWD drops the rest).
             "ipMasq": False,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": str(node.subnet), "gateway": node.ip}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(node.state_dir / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


# A real node's Lease, and how long the node lifecycle controller waits for its renewal before
# it marks the node Ready Unknown and taints it unreachable (the default is 50 s: a lost-node
# test would wait that long).
LEASE_SECONDS = 20
NODE_GRACE_SECONDS = 20


def kubelet_config(node: RealNode, pki_dir: Path, port: int, healthz_port: int) -> dict:
    taints = node.pool.node(0)["spec"]["taints"]
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # This VM has cgroup v1, which Kubernetes 1.35 refuses unless told otherwise.
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "failSwapOn": False,
        # Several kubelets share the host: each keeps its pods under its own cgroup root.
        "cgroupRoot": f"/{CGROUP_ROOT}/{node.name}", "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "address": HOST_IP, "port": port, "readOnlyPort": 0,  # the node's InternalIP: kubelet_args
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki_dir / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [DNS_SERVICE_IP], "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "",  # pods get the cluster DNS only, no host search domains
        "providerID": node.pool.node(0)["spec"]["providerID"].rsplit("/", 1)[0] + f"/{node.name}",
        "registerWithTaints": taints,
        # Images cannot be pulled back here: never garbage-collect them. Every node shares this
        # machine's one disk, so the kubelet's disk-pressure taint would only say it is nearly
        # full (the default thresholds are 10-15%): no disk-based eviction, every signal named
        # (a signal left out takes its default).
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "nodefs.inodesFree": "0%",
                         "imagefs.available": "0%", "imagefs.inodesFree": "0%"},
        "serializeImagePulls": False,
        "syncFrequency": "10s", "nodeStatusUpdateFrequency": "10s",
        # renewed every quarter of it (5 s): four renewals within the control plane's
        # --node-monitor-grace-period (NODE_GRACE_SECONDS)
        "nodeLeaseDurationSeconds": LEASE_SECONDS,
        # Its own pod-log folder: a kubelet deletes the log folders of pods it does not run, so
        # with the default /var/log/pods shared, each would delete the other's logs.
        "podLogsDir": str(node.state_dir / "pod-logs"),
    }


def kube_proxy_config(kubeconfig: Path, hostname: str, healthz_port: int, metrics_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables", "clusterCIDR": POD_NETWORK, "hostnameOverride": hostname,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}", "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # Leave the host's conntrack table size alone (a VM may refuse the sysctl).
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def corefile(kubeconfig: Path) -> str:
    # No `forward`: names outside the cluster fail at once instead of leaving this machine.
    return f""".:53 {{
    bind {HOST_IP}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""


def dns_objects() -> list[dict]:
    """The kube-dns Service, its endpoint being CoreDNS on the host (as AKS runs it in pods)."""
    ports = [{"name": "dns", "protocol": "UDP", "port": 53}, {"name": "dns-tcp", "protocol": "TCP", "port": 53}]
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
         "spec": {"clusterIP": DNS_SERVICE_IP, "ports": [dict(p, targetPort=53) for p in ports]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kube-dns-host", "namespace": "kube-system",
                      "labels": {"kubernetes.io/service-name": "kube-dns",
                                 "endpointslice.kubernetes.io/managed-by": "trainop-devcluster"}},
         "addressType": "IPv4", "ports": ports,
         "endpoints": [{"addresses": [HOST_IP], "conditions": {"ready": True}}]},
    ]


# ---- process arguments ----------------------------------------------------------------------------
def write_node_files(node: RealNode, pki_dir: Path, server: str, sandbox_image: str,
                     port: int, healthz_port: int) -> None:
    (node.state_dir / "cni").mkdir(parents=True, exist_ok=True)
    (node.state_dir / "containerd").mkdir(parents=True, exist_ok=True)
    node.containerd_root.mkdir(parents=True, exist_ok=True)
    (node.state_dir / "containerd.toml").write_text(containerd_config(node, sandbox_image))
    (node.state_dir / "cni" / "10-trainop.conflist").write_text(json.dumps(cni_config(node), indent=1))
    (node.state_dir / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_config(node, pki_dir, port, healthz_port)))
    pki.write_client_cert(pki_dir, f"node-{node.name}", f"system:node:{node.name}", "system:nodes")
    write_kubeconfig(node.state_dir / "kubeconfig", server, pki_dir, f"node-{node.name}")
    make_cgroup_root(node)


def write_kubeconfig(path: Path, server: str, pki_dir: Path, user: str) -> None:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "trainop-dev",
        "clusters": [{"name": "trainop-dev", "cluster": {"server": server,
                                                          "certificate-authority": str(pki_dir / "ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate": str(pki_dir / f"{user}.crt"),
                                          "client-key": str(pki_dir / f"{user}.key")}}],
        "contexts": [{"name": "trainop-dev", "context": {"cluster": "trainop-dev", "user": user}}],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def containerd_args(node: RealNode) -> list[str]:
    return ["--config", str(node.state_dir / "containerd.toml"), "--log-level", "warn"]


def forget_device_checkpoint() -> None:
    """Called before each kubelet starts: it then sees only its own node's device plugins."""
    with contextlib.suppress(FileNotFoundError):
        DEVICE_CHECKPOINT.unlink()


def kubelet_args(node: RealNode) -> list[str]:
    """Every node's InternalIP is HOST_IP (each kubelet serves on its own port there): the nodes
    share one network namespace, and kube-router's policy controller enforces policy for the pods
    whose status.hostIP is its node's address, so one controller covers every node's pods (one per
    node cannot work: each rewrites the whole filter table and deletes chains it did not make)."""
    labels = ",".join(f"{k}={v}" for k, v in sorted(node.labels().items()))
    return [f"--config={node.state_dir / 'kubelet.yaml'}", f"--kubeconfig={node.state_dir / 'kubeconfig'}",
            f"--hostname-override={node.name}", f"--node-ip={HOST_IP}", f"--root-dir={node.kubelet_root}",
            f"--node-labels={labels}", "--v=1"]


def network_policy_args(kubeconfig: Path, node: RealNode, service_cidr: str) -> list[str]:
    """kube-router as a NetworkPolicy controller only: no routing (the bridges route), no service
    proxy (kube-proxy serves Services), no health or metrics port. Its node names the address
    whose pods it protects: HOST_IP, i.e. every real node's pods (kubelet_args)."""
    return ["--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            f"--kubeconfig={kubeconfig}", f"--hostname-override={node.name}",
            f"--service-cluster-ip-range={service_cidr}", "--enable-ipv4=true", "--enable-ipv6=false",
            "--health-port=0", "--metrics-port=0", "--v=1"]


def network_policy_armed() -> bool:
    """kube-router has made its chains and hooked them into FORWARD (its first full sync)."""
    return "-j KUBE-ROUTER-FORWARD" in sh("iptables", "-S", "FORWARD", check=False).stdout


def require_ipset() -> None:
    if shutil.which("ipset") is None:
        raise NodeSetupError("the `ipset` command is missing (kube-router's network policy controller needs it): "
                             "apt-get install ipset, or run scripts/bootstrap.sh test")


def device_plugin_args(node: RealNode) -> dict[str, list[str]]:
    """component name -> arguments of each stand-in device plugin this node's pool needs."""
    out = {}
    for resource, count in node.pool.devices().items():
        out[f"device-plugin-{resource.split('/')[-1]}/{node.name}"] = [
            f"-resource={resource}", f"-count={count}", f"-dir={node.kubelet_root / 'plugins_registry'}",
            f"-env={DEVICE_ENV.get(resource, '')}"]
    return out


# ---- one real-node cluster per machine ------------------------------------------------------------
def other_owner(state_dir: Path, alive) -> str | None:
    """The state folder of another live dev cluster that runs real nodes here, if any."""
    try:
        owner = json.loads(HOST_LOCK.read_text())
    except (OSError, ValueError):
        owner = {}
    other = owner.get("state_dir")
    return other if other and Path(other) != state_dir and alive(other) else None


def claim_host(state_dir: Path, alive) -> None:
    """Refuse if another live dev cluster runs real nodes here; else take the host over."""
    other = other_owner(state_dir, alive)
    if other:
        raise NodeSetupError(f"another dev cluster runs real nodes on this machine ({other}); "
                             "stop it first (trainop devcluster down, or end its test session)")
    HOST_LOCK.write_text(json.dumps({"state_dir": str(state_dir), "pid": os.getpid()}))


def release_host(state_dir: Path) -> None:
    try:
        if json.loads(HOST_LOCK.read_text()).get("state_dir") == str(state_dir):
            HOST_LOCK.unlink()
    except (OSError, ValueError):
        pass


def leftovers(state_dir: Path) -> list[str]:
    """What real nodes made that still exists (empty after a clean `down`): interfaces, the host
    address, a killed node's blackhole route, iptables chains (ours, kube-proxy's, the kubelet's,
    kube-router's), kube-router's ipsets, cgroups, mounts and processes."""
    found = [f"interface {link['ifname']}" for link in json.loads(sh("ip", "-j", "link", "show").stdout or "[]")
             if link["ifname"].startswith("trainop")]
    if HOST_IP in sh("ip", "-o", "addr", "show", "dev", "lo").stdout:
        found.append(f"address {HOST_IP} on lo")
    found += [f"blackhole route {dst}" for dst in _silent_routes()]
    for table in ("filter", "nat", "mangle"):
        found += [f"iptables {table} chain {line.split()[1]}" for line in
                  sh("iptables", "-t", table, "-S", check=False).stdout.splitlines()
                  if line.startswith("-N ") and line.split()[1].startswith(("KUBE-", "TRAINOP-"))]
    found += [f"ipset {name}" for name in _ipsets()]
    found += [f"cgroup {h / CGROUP_ROOT}" for h in _cgroup_hierarchies() if (h / CGROUP_ROOT).exists()]
    prefix = str(state_dir.resolve()) + "/"
    found += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(prefix)]
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and prefix.encode() in (proc / "cmdline").read_bytes():
                found.append(f"process {proc.name}: {(proc / 'cmdline').read_bytes()[:120]!r}")
    return found


def remove_state(node_states: list[Path]) -> None:
    for folder in node_states:
        unmount_under(folder)
        shutil.rmtree(folder, ignore_errors=True)
