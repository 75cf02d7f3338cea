"""CPU per watch event through kopf's own processing (kopf.index functions, then the on.event
routers), with the operator's handlers and kopf settings, no API server: what one event of a
job's pod, launcher Job or Service costs the operator's event loop before any reconcile (issue 30).

    .venv/bin/python bench/kopf_events.py                          # this checkout
    .venv/bin/python bench/kopf_events.py /tmp/base-X .             # side by side (git worktree add)

Each DIR's operator/ runs in a process of its own; with several, they take turns in each round
and the table gives each one's median over the rounds (CPU time of the process, so another
process on the cores moves it far less than the wall-clock benches; a 100-job ramp in
bench/control_plane.py varies by 20 % from run to run on this project's 2-core machine, too
much to see a change of a few percent). The controller behind the routers is a stand-in that
does nothing: what is measured is kopf's work and the index functions'. A checkout that
watches a kind itself (informer.py) handles its event in its own cache instead
(handlers/caches.py: observe, the indexes and the routing). Neither side's decoding of the
event or its queueing before this step is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("Pod", "Job", "Service")


def _body(kind: str, i: int, label: str) -> dict:
    meta = {"name": f"j{i}-{kind.lower()}", "namespace": "bench", "uid": f"{kind}-{i}",
            "resourceVersion": str(i), "labels": {label: f"j{i}"}}
    if kind == "Pod":
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"nodeName": "node-1", "containers": [
                    {"name": "worker", "image": "trainer", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
                "status": {"phase": "Running", "podIP": "10.0.0.1", "containerStatuses": [
                    {"name": "worker", "ready": True, "restartCount": 0, "state": {"running": {}}}]}}
    if kind == "Job":
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {},
                "status": {"active": 1}}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"clusterIP": "None"}}


class _Nothing:
    """The controller the routers call: every attribute and call is a no-op."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return None


async def _measure(events: int) -> dict:
    import kopf
    from kopf._cogs.structs import ephemera, references
    from kopf._core.actions import lifecycles
    from kopf._core.engines import indexing
    from kopf._core.reactor import inventory, processing

    from trainop.handlers import indexes
    from trainop.main import _NoDiffBase

    registry = kopf.get_default_registry()
    settings = kopf.OperatorSettings()  # what main.configure changes that the processing reads
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="trainop.io")
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.posting.enabled = False
    indexers = indexing.OperatorIndexers()
    indexers.ensure(registry._indexing.get_all_handlers())
    memories, memo = inventory.ResourceMemories(), ephemera.Memo()
    memo.controller = _Nothing()
    resources = {"Pod": ("", "v1", "pods"), "Job": ("batch", "v1", "jobs"), "Service": ("", "v1", "services")}

    own = {}  # kind -> the cache of a checkout that watches it itself (informer.py)
    try:
        from trainop.handlers import caches
        for _, kind, _, cls in caches.WATCHED:
            own[kind] = cls(_Nothing())
    except ImportError:
        pass

    async def run(kind: str) -> None:
        if kind in own:
            for i in range(events):
                own[kind].observe("MODIFIED", _body(kind, i, indexes.LABEL_JOB))
            return
        group, version, plural = resources[kind]
        resource = references.Resource(group=group, version=version, plural=plural, kind=kind,
                                       singular=kind.lower(), namespaced=True, verbs=["list", "watch"])
        posted: asyncio.Queue = asyncio.Queue()  # (kopf's own Events: off, as in the operator)
        for i in range(events):
            await processing.process_resource_event(
                lifecycle=lifecycles.all_at_once, indexers=indexers, registry=registry, settings=settings,
                memories=memories, memobase=memo, resource=resource, event_queue=posted,
                raw_event={"type": "MODIFIED", "object": _body(kind, i, indexes.LABEL_JOB)}, no_throttling=True)

    out = {"index handlers": len(list(registry._indexing.get_all_handlers())), "indexes": len(indexers)}
    for kind in KINDS:
        await run(kind)  # warm: the objects' memories exist, as in a ramp's later events
        started = time.process_time()
        await run(kind)
        out[kind] = round(1e6 * (time.process_time() - started) / events, 1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="*", default=["."], metavar="DIR", help="checkouts (default: this one)")
    p.add_argument("--events", type=int, default=3000, help="events of each kind per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_measure(args.events))))
        return 0
    runs: dict[str, list[dict]] = {d: [] for d in args.dirs}
    for _ in range(args.rounds):
        for d in args.dirs:
            env = dict(os.environ, PYTHONPATH=str(Path(d).resolve() / "operator"))
            done = subprocess.run([sys.executable, __file__, "--child", "--events", str(args.events)],
                                  env=env, capture_output=True, text=True, check=True)
            runs[d].append(json.loads(done.stdout.splitlines()[-1]))
    print("| operator | index handlers | indexes | " + " | ".join(f"us CPU per {k} event" for k in KINDS) + " |")
    print("|---|---|---|" + "---|" * len(KINDS))
    for d, results in runs.items():
        medians = [statistics.median(r[k] for r in results) for k in KINDS]
        print(f"| {d} | {results[0]['index handlers']} | {results[0]['indexes']} | "
              + " | ".join(f"{m:.0f}" for m in medians) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
