"""THE entry module: `trainop operator` runs kopf with this module, and so do the Helm chart's
Deployment and the test fixture. It imports every handler module, sets kopf's settings and
starts the controller (controller.py) that the index handlers wake, and the Lease election
(leader.py) that decides whether this replica acts.

Every kopf handler here only reads (indexes, routing, metrics), and so do the operator's own
watches (informer.py): both run the same on a standby replica, whose caches stay warm, and
kopf's own writes (finalizers, progress annotations, Events, peering) are all off. To add a
resource's handlers, add one import line below.
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from trainop import config, controller, crds, fastjson, informer, kube, leader
from trainop.handlers import (
    caches,
    indexes,  # noqa: F401  (watch caches, wake-up routing, metrics)
)


class _NoDiffBase(kopf.DiffBaseStorage):
    """kopf builds a diff base (a deep copy of the whole object) and reads the stored one from
    an annotation on every watch event of every watched resource, for on.create/on.update
    handlers to compare against. trainop has none (decisions come from the indexes): the copy,
    measured at a third of the event loop's CPU with 100 jobs, and the annotation lookups
    (3% more, issue 30) are skipped."""

    def build(self, *, body, extra_fields=None):
        return None

    def fetch(self, *, body):
        return None

    def store(self, *, body, patch, essence):
        pass


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger,
                    **kwargs) -> None:
    memo.config = config.load()
    # set by `trainop operator --lease` (cli/operator.py); one replica without it
    leadership = getattr(memo, "leadership", None) or leader.Solo()
    kube.configure(user_agent=f"trainop/{getattr(leadership, 'holder', leader.identity())}")
    kube.fence(leadership.may_write)  # no write of ours leaves a replica that is not the leader
    # Kopf's bookkeeping goes to annotations under our group, never into our status schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="trainop.io")
    settings.persistence.diffbase_storage = _NoDiffBase()
    fastjson.install()
    crds.preload()  # every job's spec is defaulted and validated against them
    # No kopf finalizer: a job has none (its children go with it through owner references, even
    # while the operator is down) and a DataStage's (its PV) is the reconcile's (stagesync), so
    # that a standby's kopf never adds or removes one. (kopf's default marker name, which no
    # trainop object carries: kopf would take off a finalizer of its own name that no handler
    # requires, and trainop.io/finalizer is stagesync's.)
    # Events come from the controller (one per condition transition), on the leader only.
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.networking.connect_timeout = 10
    settings.networking.request_timeout = 30
    # kopf's default waits grow to 8, 13 and 21 s: a watch cut by an API server restart came back
    # 15 s after the server did (bench/chaos.py). At most 5 s apart, still 40 s before a request
    # gives up (a watch never does: kopf starts it again).
    settings.networking.error_backoffs = [1, 1, 2, 2, 3, 3, 5, 5, 5, 5, 5]
    settings.execution.max_workers = 16
    # kopf keeps one worker task per object for 5 s after its last event; in a burst of new
    # jobs thousands of them wait at once, each with its queue and coroutine frames (issue 30:
    # with this and spec.Nodes, the peak RSS at 500 jobs fell from 162 to 147 MB in one A/B
    # run). An object's next event after 1 s of quiet just starts a new one.
    settings.queueing.idle_timeout = 1.0
    indexes.configure(settings)
    memo.controller = controller.Controller(memo.config, {k: kwargs[k] for k in indexes.INDEXES},
                                            leadership)
    memo.controller.start()  # (its workers wait for the pods' first lists)
    # pods and a job's core children from watches of the operator's own (informer.py says
    # why), in the namespaces kopf watches
    memo.own_watches = informer.Watches(getattr(memo, "namespaces", []),
                                        caches.watches(memo.controller.caches),
                                        asyncio.get_running_loop(), memo.controller.synced)
    memo.own_watches.start()
    memo.election = asyncio.create_task(leadership.run(on_lost=getattr(memo, "stop", _no_stop)),
                                        name="trainop-lease")
    logger.info("trainop operator configured: %d node pools, safety resync %.0fs",
                len(memo.config.node_pools), memo.config.safety_resync_seconds)


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_) -> None:
    if getattr(memo, "own_watches", None) is not None:
        memo.own_watches.stop()
    if getattr(memo, "controller", None) is not None:
        await memo.controller.stop()
    if getattr(memo, "election", None) is not None:
        memo.election.cancel()
    if getattr(memo, "leadership", None) is not None:
        await memo.leadership.release()  # a standby takes over at once, not at expiry
    if getattr(memo, "stop_flag", None) is not None:
        memo.stop_flag.set()  # cli/operator.py says why: without it the process never exits


def _no_stop() -> None:
    raise RuntimeError("a Lease without a stop flag")  # cli/operator.py always gives one
