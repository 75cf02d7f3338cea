"""Simulated AKS node pools: Node objects shaped like the ones AKS registers, for KWOK to run.

Sizes follow real Azure VM sizes so placement tests mean something: an NC-style GPU pool without
InfiniBand and an ND-style pool with 8 GPUs and an RDMA device per node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/ib"
# The taint GPU pools carry so only pods that tolerate it (and ask for GPUs) land there.
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
REGION = "eastus"


@dataclass(frozen=True)
class NodePool:
    name: str
    count: int
    vm_size: str
    cpu: str
    memory: str
    gpus: int = 0
    rdma: int = 0
    mode: str = "user"
    # True: the pool's nodes are real kubelets (devcluster/nodes.py) instead of KWOK nodes.
    real: bool = False

    def node_names(self) -> list[str]:
        # AKS names nodes aks-<pool>-<scale-set-id>-vmss<index, 6 base-36 digits>.
        return [f"aks-{self.name}-12345678-vmss{i:06d}" for i in range(self.count)]

    def node(self, index: int) -> dict:
        name = self.node_names()[index]
        labels = {
            "kubernetes.azure.com/agentpool": self.name,
            "agentpool": self.name,
            "kubernetes.azure.com/mode": self.mode,
            "kubernetes.azure.com/cluster": "MC_trainop_dev_eastus",
            "kubernetes.azure.com/os-sku": "Ubuntu",
            "node.kubernetes.io/instance-type": self.vm_size,
            "beta.kubernetes.io/instance-type": self.vm_size,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "kubernetes.io/hostname": name,
            "topology.kubernetes.io/region": REGION,
            "topology.kubernetes.io/zone": f"{REGION}-{index % 3 + 1}",
            "type": "kwok",
        }
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110", "ephemeral-storage": "1Ti"}
        taints = []
        if self.gpus:
            labels["kubernetes.azure.com/accelerator"] = "nvidia"
            capacity[GPU_RESOURCE] = str(self.gpus)
            taints.append(dict(GPU_TAINT))
        if self.rdma:
            labels["kubernetes.azure.com/infiniband"] = "true"
            capacity[RDMA_RESOURCE] = str(self.rdma)
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": labels,
                # KWOK manages only nodes carrying this annotation (see cluster.py's kwok flags).
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"taints": taints, "providerID": f"azure:///trainop-dev/{name}"},
            "status": {"capacity": capacity, "allocatable": dict(capacity)},
        }

    def nodes(self) -> list[dict]:
        """Node objects for KWOK to run (a real pool's nodes register themselves)."""
        return [] if self.real else [self.node(i) for i in range(self.count)]

    def devices(self) -> dict[str, int]:
        """Extended resources a device plugin advertises on each node of the pool."""
        return {k: v for k, v in ((GPU_RESOURCE, self.gpus), (RDMA_RESOURCE, self.rdma)) if v}


def default_pools(system: int = 2, gpu: int = 4, ibgpu: int = 4) -> list[NodePool]:
    pools = [
        NodePool("system", system, "Standard_D8s_v5", cpu="8", memory="32Gi", mode="system"),
        NodePool("gpu", gpu, "Standard_NC96ads_A100_v4", cpu="96", memory="880Gi", gpus=4),
        NodePool("ibgpu", ibgpu, "Standard_ND96isr_H100_v5", cpu="96", memory="1900Gi", gpus=8, rdma=8),
    ]
    return [p for p in pools if p.count > 0]


def _counts(text: str, flag: str) -> dict[str, int]:
    counts = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("=")
        if name not in ("system", "gpu", "ibgpu") or not count.isdigit():
            raise ValueError(f"{flag}: expected NAME=COUNT with NAME one of system, gpu, ibgpu; got {item!r}")
        counts[name] = int(count)
    return counts


def parse_pools(text: str, real: str = "") -> list[NodePool]:
    """'system=2,gpu=4,ibgpu=0' -> pools with those node counts (unnamed pools keep defaults).

    real: 'gpu=1,system=1' (or 'N', meaning gpu=N) makes those pools real with that many nodes:
    a pool is either simulated or real, so a pod placed on it by its selector really runs."""
    counts = _counts(text, "--pools")
    real_counts = {"gpu": int(real)} if real.strip().isdigit() else _counts(real, "--real-nodes")
    pools = default_pools(**(counts | real_counts))
    return [replace(p, real=True) if p.name in real_counts else p for p in pools]
