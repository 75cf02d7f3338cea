"""leader.Lease's rounds against an in-memory Lease with the API server's optimistic concurrency
(a write with a stale resourceVersion is a 409), on a clock the test moves. The real thing, two
processes and a kill: tests/cluster/test_chaos.py."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client.exceptions import ApiException

from trainop import kube, leader


class FakeLeases:
    def __init__(self):
        self.obj: dict | None = None
        self.version = 0

    def get(self, api_version, kind, name, namespace=None):
        return copy.deepcopy(self.obj)

    def request(self, method, url, *, body=None, fenced=True, **_):
        assert fenced is False  # the Lease's own writes pass the fence
        if method == "POST" and self.obj is not None:
            raise ApiException(status=409)
        if method == "PUT" and body["metadata"].get("resourceVersion") != self.obj["metadata"]["resourceVersion"]:
            raise ApiException(status=409)
        self.version += 1
        self.obj = copy.deepcopy(body)
        self.obj["metadata"]["resourceVersion"] = str(self.version)
        return self.obj


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def leases(monkeypatch):
    fake = FakeLeases()
    monkeypatch.setattr(kube, "get", lambda *a, **k: fake.get(*a, **k))  # (a test may swap it)
    monkeypatch.setattr(kube, "request", fake.request)
    return fake


def elector(name: str, clock: Clock) -> leader.Lease:
    return leader.Lease("trainop", "ns", name, clock=clock)


def test_one_holder_the_other_takes_over_once_it_saw_the_lease_unchanged_for_its_duration(leases):
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert a.try_acquire_or_renew() and a.may_write()
    for _ in range(10):  # both every retry period: a renews, b stands by
        clock.now += leader.RETRY_SECONDS
        assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    last_renewal, took = clock.now, None
    while took is None:  # a is killed: b keeps trying
        clock.now += leader.RETRY_SECONDS
        took = clock.now if b.try_acquire_or_renew() else None
        if clock.now - last_renewal >= leader.RENEW_DEADLINE:
            assert not a.may_write()  # a stopped writing well before b started
    assert leader.LEASE_SECONDS <= took - last_renewal <= leader.LEASE_SECONDS + leader.RETRY_SECONDS
    assert leases.obj["spec"]["holderIdentity"] == "b" and leases.obj["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew() and not a.may_write()  # a, back, does not get it back


def test_a_candidate_that_just_came_waits_a_full_lease(leases):
    """An expired-looking renewTime is not trusted (clocks differ): only what this replica saw."""
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    a.try_acquire_or_renew()
    clock.now += 60
    assert not b.try_acquire_or_renew()  # first sight
    clock.now += leader.LEASE_SECONDS + 0.5
    assert b.try_acquire_or_renew()


def test_of_two_writers_of_one_version_the_second_gets_a_conflict(leases):
    clock = Clock()
    a, b, c = elector("a", clock), elector("b", clock), elector("c", clock)
    a.try_acquire_or_renew()
    b.try_acquire_or_renew(), c.try_acquire_or_renew()  # both see it
    clock.now += leader.LEASE_SECONDS + 1
    read_by_c = leases.get(None, None, None)
    assert b.try_acquire_or_renew()
    leases.get = lambda *_: copy.deepcopy(read_by_c)  # c read before b's write
    assert not c.try_acquire_or_renew() and not c.may_write()  # 409
    assert leases.obj["spec"]["holderIdentity"] == "b"


def test_the_fence_closes_at_the_renew_deadline(leases):
    clock = Clock()
    a = elector("a", clock)
    a.try_acquire_or_renew()
    clock.now += leader.RENEW_DEADLINE - 0.1
    assert a.may_write()
    clock.now += 0.2
    assert not a.may_write()


def test_solo_always_leads():
    assert leader.Solo().may_write() and leader.Solo().is_leading()
