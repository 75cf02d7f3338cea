"""One real-node cluster per machine (devcluster/nodes.py's host lock): a second cluster that
starts or stops while another owns the host must not tear down the owner's bridges, host
address or node cgroups, whose names every cluster shares. Seen: a CI run's `up` (which calls
`down` first) removed a live cluster's network under its running tests. The host's network
itself is not touched here: the teardown functions are replaced by recorders (named stand-ins,
not mocks of what is tested, which is the decision)."""

from __future__ import annotations

import json
from pathlib import Path

from trainop.devcluster import nodes
from trainop.devcluster.cluster import DevCluster


def _record(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("kill_node_processes", "remove_cni_netns", "remove_state", "teardown_host_network",
                 "remove_cgroups"):
        monkeypatch.setattr(nodes, name, lambda *a, _n=name: calls.append(_n))
    return calls


def test_stopping_leaves_the_host_to_the_live_cluster_that_owns_it(tmp_path, monkeypatch):
    lock = tmp_path / "host.json"
    monkeypatch.setattr(nodes, "HOST_LOCK", lock)
    calls = _record(monkeypatch)
    other = tmp_path / "other"
    lock.write_text(json.dumps({"state_dir": str(other), "pid": 1}))
    mine = DevCluster(tmp_path / "mine")
    live = {str(other)}
    monkeypatch.setattr(DevCluster, "is_up", lambda self: str(self.state_dir) in live)

    mine._remove_real_nodes([], proxy_ran=False)
    assert calls == [] and json.loads(lock.read_text())["state_dir"] == str(other)

    live.clear()  # the owner is gone: its leftovers are anyone's to clean
    mine._remove_real_nodes([], proxy_ran=False)
    assert "teardown_host_network" in calls and "remove_cgroups" in calls
    assert nodes.other_owner(Path(tmp_path / "mine"), lambda s: False) is None


def test_a_killed_nodes_blackhole_route_is_a_leftover_while_it_is_there(tmp_path):
    """The one test here that touches the host: a route of kill_node's kind, on a subnet no
    node uses (real nodes take 10.245.<index>.0/24 from 0 up), in the real routing table.
    (Not teardown_host_network itself, which removes it through the same _silent_routes: it would
    take down the real-node cluster the e2e lane's session still holds while tests/unit run.)"""
    dst = "10.245.250.0/24"
    nodes.sh("ip", "route", "replace", "blackhole", dst, "metric", nodes.SILENT_METRIC)
    try:
        assert f"blackhole route {dst}" in nodes.leftovers(tmp_path)
        assert dst in nodes._silent_routes()
    finally:
        nodes.sh("ip", "route", "del", "blackhole", dst, "metric", nodes.SILENT_METRIC, check=False)
    assert f"blackhole route {dst}" not in nodes.leftovers(tmp_path)
