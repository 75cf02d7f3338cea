"""Where this process sits in the job: rank, size and rendezvous, read from the launcher's environment.

mpirun (Open MPI) exports OMPI_COMM_WORLD_*; torchrun exports RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT. Native backends that need an address under mpirun take it from
MASTER_ADDR or from the hostfile the launcher was given (the operator mounts it and points
OMPI_MCA_orte_default_hostfile at it, as the MPI Operator does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 29500
HOSTFILE_VARS = ("OMPI_MCA_orte_default_hostfile", "OMPI_MCA_prte_default_hostfile", "TRAINOP_HOSTFILE")


class WorldError(ValueError):
    """The launcher's environment does not say where the other ranks are."""


@dataclass(frozen=True)
class World:
    launcher: str  # "mpirun", "torchrun" or "single"
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int
    # Host of every rank, in rank order (Open MPI's default by-slot mapping of the hostfile).
    hosts: tuple[str, ...]

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def parse_hostfile(text: str) -> list[tuple[str, int]]:
    """Open MPI hostfile lines `host slots=N` (or bare `host`, one slot) -> [(host, slots)]."""
    entries = []
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        slots = next((int(f[6:]) for f in fields[1:] if f.startswith("slots=") and f[6:].isdigit()), 1)
        entries.append((fields[0], slots))
    return entries


def _hosts_by_slot(entries: list[tuple[str, int]], size: int) -> tuple[str, ...]:
    hosts = [host for host, slots in entries for _ in range(slots)]
    if len(hosts) < size:
        raise WorldError(f"hostfile has {len(hosts)} slots for {size} ranks; give every worker `slots=<GPUs>`")
    return tuple(hosts[:size])


def detect(env: os._Environ | dict = os.environ) -> World:
    port = int(env.get("MASTER_PORT", DEFAULT_PORT))
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, size = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local_rank = int(env["OMPI_COMM_WORLD_LOCAL_RANK"])
        local_size = int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
        hostfile = next((env[v] for v in HOSTFILE_VARS if env.get(v)), None)
        if hostfile:
            hosts = _hosts_by_slot(parse_hostfile(Path(hostfile).read_text()), size)
        elif local_size == size:
            hosts = ("127.0.0.1",) * size
        else:
            raise WorldError(
                "ranks span several hosts but no hostfile is known; set OMPI_MCA_orte_default_hostfile"
            )
        return World("mpirun", rank, size, local_rank, local_size, env.get("MASTER_ADDR", hosts[0]), port, hosts)
    if "RANK" in env and "WORLD_SIZE" in env:
        size = int(env["WORLD_SIZE"])
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        # torchrun tells each rank only the master's address: other ranks' hosts are known
        # only when all ranks share one host.
        hosts = (addr,) * size if local_size == size else ()
        return World("torchrun", int(env["RANK"]), size, int(env.get("LOCAL_RANK", 0)), local_size, addr, port, hosts)
    return World("single", 0, 1, 0, 1, "127.0.0.1", port, ("127.0.0.1",))
