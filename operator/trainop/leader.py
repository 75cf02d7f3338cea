"""Which replica acts: leader election with a coordination.k8s.io Lease, as client-go's
leaderelection does it (the MPI Operator's cmd/mpi-operator/app/server.go: a LeaseLock, 15 s
lease), with warm standbys: every replica watches and fills its caches; only the holder of the
Lease reconciles, writes status, posts Events or runs a deadline.

    leadership = leader.Lease("trainop", "trainop-system", identity)   # or leader.Solo()
    task = asyncio.create_task(leadership.run(on_lost=stop_the_process))
    await leadership.wait_leading()      # the controller's workers and resync wait here
    leadership.may_write()               # kube.py's fence: every write checks it, in any thread

Why not kopf's peering (what the chart used before): kopf keeps its pause state (a ToggleSet in
kopf._core.reactor.running) to itself: no handler argument, setting or API tells a task that is
not a kopf handler (the controller's workers, its resync, its deadlines) that the replica is
paused, so those went on acting on frozen caches. A paused kopf also closes its watches, so a
standby's caches are stale when it resumes; replicas of equal priority all pause; and the pause
is only as quick as each replica's watch of the peering object (kopf: "no per-object locks").
A Lease is one object updated with optimistic concurrency (resourceVersion): the API server
lets one holder renew it at a time.

Safety: the holder stops writing RENEW_DEADLINE seconds after its last successful renewal
began (the fence is a clock check, so it holds in pool threads even while the event loop is
busy), and a candidate takes the Lease only after it saw the record unchanged for
LEASE_SECONDS by its own clock; LEASE_SECONDS > RENEW_DEADLINE is the margin (no clock sync
needed, only similar clock rates). A replica that lost the Lease exits (client-go's and the MPI
Operator's choice): its Deployment restarts it as a standby with fresh caches and memory. A
clean stop releases the Lease, so a standby takes over within RETRY_SECONDS; after a crash it
takes over once the lease has expired (LEASE_SECONDS + up to RETRY_SECONDS).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from trainop import kube

log = logging.getLogger("trainop.leader")
API_VERSION = "coordination.k8s.io/v1"
LEASE_SECONDS = 15   # client-go's default, the MPI Operator's value
RENEW_DEADLINE = 10  # the holder stops acting this long after its last renewal began
RETRY_SECONDS = 2    # how often the holder renews and a candidate tries


def identity() -> str:
    """This replica's name in the Lease: the pod's name (POD_ID, as the chart sets it) or the
    host's, plus a random suffix so that two processes on one host never share it."""
    base = os.environ.get("POD_ID") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def _micro_time() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Solo:
    """One replica and no election (`trainop operator` without --lease): always the leader."""

    name = "solo"

    def may_write(self) -> bool:
        return True

    def is_leading(self) -> bool:
        return True

    async def wait_leading(self) -> None:
        return None

    async def run(self, on_lost: Callable[[], None]) -> None:
        return None

    async def release(self) -> None:
        return None


class Lease:
    def __init__(self, name: str, namespace: str, holder: str, *,
                 lease_seconds: float = LEASE_SECONDS, renew_deadline: float = RENEW_DEADLINE,
                 retry_seconds: float = RETRY_SECONDS, clock: Callable[[], float] = time.monotonic):
        if not lease_seconds > renew_deadline > retry_seconds > 0:
            raise ValueError("lease_seconds > renew_deadline > retry_seconds > 0")
        self.name, self.namespace, self.holder = name, namespace, holder
        self.lease_seconds, self.renew_deadline = lease_seconds, renew_deadline
        self.retry_seconds, self.clock = retry_seconds, clock
        self._renewed_at: float | None = None   # when our last successful renewal began
        self._observed: tuple | None = None     # the Lease record as last read
        self._observed_at = 0.0                 # when it last changed, by our clock
        self._leading: asyncio.Event | None = None
        self.became_leader_at: float | None = None  # time.time() of the takeover (tests, logs)

    # ---- what the rest of the operator asks ------------------------------------------------

    def may_write(self) -> bool:
        """Thread-safe: True while our last renewal is younger than the renew deadline."""
        at = self._renewed_at
        return at is not None and self.clock() - at < self.renew_deadline

    def is_leading(self) -> bool:
        return self._leading is not None and self._leading.is_set() and self.may_write()

    async def wait_leading(self) -> None:
        await self._event().wait()

    def _event(self) -> asyncio.Event:
        if self._leading is None:
            self._leading = asyncio.Event()
        return self._leading

    # ---- the loop --------------------------------------------------------------------------

    async def run(self, on_lost: Callable[[], None]) -> None:
        """Try to acquire, then renew, every retry period; call `on_lost` once if a renewal
        misses the deadline (the replica must then stop: see the module's docstring)."""
        loop, leading = asyncio.get_running_loop(), self._event()
        log.info("standing by for Lease %s/%s as %s", self.namespace, self.name, self.holder)
        while True:
            try:
                await loop.run_in_executor(None, self.try_acquire_or_renew)
            except Exception as exc:  # the API server unreachable: the deadline decides
                log.warning("Lease %s/%s: %s", self.namespace, self.name,
                            f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else exc)
            if self.may_write() and not leading.is_set():
                self.became_leader_at = time.time()
                log.info("acquired Lease %s/%s: this replica acts now", self.namespace, self.name)
                leading.set()
            elif leading.is_set() and not self.may_write():
                leading.clear()
                log.error("lost Lease %s/%s (no renewal for %.0fs): stopping, so that a fresh "
                          "process stands by", self.namespace, self.name, self.renew_deadline)
                on_lost()
                return
            await asyncio.sleep(self.retry_seconds)

    def try_acquire_or_renew(self) -> bool:
        """One round of client-go's tryAcquireOrRenew (blocking: run it in a thread)."""
        began = self.clock()
        lease = kube.get(API_VERSION, "Lease", self.name, self.namespace)
        now = _micro_time()
        if lease is None:
            body = {"apiVersion": API_VERSION, "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {"holderIdentity": self.holder,
                             "leaseDurationSeconds": int(self.lease_seconds),
                             "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
            return self._write("POST", kube.path(API_VERSION, "Lease", self.namespace), body, began)
        spec = lease.get("spec") or {}
        record = tuple(spec.get(k) for k in ("holderIdentity", "renewTime", "leaseTransitions",
                                             "leaseDurationSeconds"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        holder = spec.get("holderIdentity")
        duration = spec.get("leaseDurationSeconds") or self.lease_seconds
        if holder and holder != self.holder and self._observed_at + duration > self.clock():
            return False  # another replica's, and not expired by our clock
        new = {**spec, "holderIdentity": self.holder, "renewTime": now,
               "leaseDurationSeconds": int(self.lease_seconds)}
        if holder != self.holder:
            new |= {"acquireTime": now, "leaseTransitions": (spec.get("leaseTransitions") or 0) + 1}
        lease["spec"] = new  # (metadata.resourceVersion: a concurrent writer makes this a 409)
        return self._write("PUT", kube.path(API_VERSION, "Lease", self.namespace, self.name),
                           lease, began)

    def _write(self, method: str, url: str, body: dict, began: float) -> bool:
        try:
            kube.request(method, url, body=body, fenced=False)  # the Lease is how we get the right
        except ApiException as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise
        self._renewed_at = began
        return True

    async def release(self) -> None:
        """On a clean stop: give the Lease up at once (client-go's ReleaseOnCancel) so that a
        standby need not wait for it to expire."""
        if not self.may_write():
            return
        self._renewed_at = None  # nothing more from us, whatever the release's outcome
        if self._leading is not None:
            self._leading.clear()
        lease = await asyncio.get_running_loop().run_in_executor(
            None, kube.get, API_VERSION, "Lease", self.name, self.namespace)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.holder:
            return
        now = _micro_time()
        lease["spec"] |= {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": now}
        try:
            await asyncio.get_running_loop().run_in_executor(None, lambda: kube.request(
                "PUT", kube.path(API_VERSION, "Lease", self.namespace, self.name), body=lease,
                fenced=False))
            log.info("released Lease %s/%s", self.namespace, self.name)
        except ApiException as exc:
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc.reason)
