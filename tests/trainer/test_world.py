"""Rank, size and rendezvous from the launchers' environments (pure functions, no launch)."""

import pytest

from trainop_trainer import world

pytestmark = pytest.mark.trainer


def test_hostfile_slots_map_ranks_by_slot(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# written by the operator\njob-worker-0.job slots=2\njob-worker-1.job slots=2\n")
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_default_hostfile": str(hostfile)}
    w = world.detect(env)
    assert (w.launcher, w.rank, w.size, w.local_rank) == ("mpirun", 3, 4, 1)
    assert w.hosts == ("job-worker-0.job",) * 2 + ("job-worker-1.job",) * 2
    assert w.master_addr == "job-worker-0.job" and w.master_port == world.DEFAULT_PORT


def test_bare_host_lines_count_one_slot():
    assert world.parse_hostfile("a\nb slots=3 max_slots=4\n\n") == [("a", 1), ("b", 3)]


def test_mpirun_across_hosts_without_hostfile_is_an_error():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(world.WorldError, match="OMPI_MCA_orte_default_hostfile"):
        world.detect(env)


def test_hostfile_with_too_few_slots_is_an_error(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\n")
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "TRAINOP_HOSTFILE": str(hostfile)}
    with pytest.raises(world.WorldError, match="1 slots for 2 ranks"):
        world.detect(env)


def test_torchrun_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    w = world.detect(env)
    assert (w.launcher, w.rank, w.size, w.master_addr, w.master_port) == ("torchrun", 1, 2, "10.0.0.5", 1234)
    assert w.hosts == ("10.0.0.5", "10.0.0.5")
    multi_node = world.detect({**env, "WORLD_SIZE": "4"})
    assert multi_node.hosts == ()  # other nodes' addresses are unknown under torchrun


def test_single_process():
    w = world.detect({})
    assert (w.launcher, w.rank, w.size, w.is_chief) == ("single", 0, 1, True)
