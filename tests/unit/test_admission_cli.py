"""`trainop quota`'s table row from live objects (pure part of cli/quota.py)."""

from trainop.cli import quota


def rq(name, hard, used):
    return {"metadata": {"name": name}, "spec": {"hard": {"requests.nvidia.com/gpu": hard}},
            "status": {"used": {"requests.nvidia.com/gpu": used}}}


def dtj(phase, gpus, admitted):
    conds = [{"type": "Admitted", "status": "True" if admitted else "False"}]
    return {"spec": {}, "status": {"phase": phase, "gpus": gpus, "conditions": conds}}


def pod(gpus, phase="Running"):
    return {"metadata": {"name": "p"}, "status": {"phase": phase},
            "spec": {"containers": [{"name": "c", "resources": {
                "limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def test_row_names_the_quota_with_the_least_room():
    jobs = [dtj("Running", 8, True), dtj("Queued", 16, False), dtj("Queued", 4, False),
            dtj("Succeeded", 8, True)]
    row = quota.row("team-a", [rq("big", "64", "8"), rq("tight", "24", "16"),
                               {"metadata": {"name": "pods"}, "spec": {"hard": {"pods": "9"}}}],
                    [], jobs)
    assert row == ("team-a", "tight", "24", "16", 1, 2, 20)


def test_row_without_a_gpu_quota_counts_running_pods():
    row = quota.row("team-b", [], [pod(4), pod(4, "Succeeded"), pod(2)], [])
    assert row == ("team-b", "-", "-", "6", 0, 0, 0)
