"""The operator's own list-then-watch (client-go's reflector) of pods and of a job's launcher Job,
Services, ConfigMaps and NetworkPolicy, beside kopf's watches of the other kinds.

Why not kopf for these: kopf runs each watch event through its handler machinery (a handler's
keyword arguments with every index in them, its state, outcome and logger), about 250-350 µs of
CPU per event on this project's machine (bench/kopf_events.py), and these kinds send most of
the events of a ramp of new jobs. Here an event costs its decode, its slimming and a few dict
writes, 5-10 µs (handlers/caches.py). kopf keeps the custom resources and every kind whose API
may be absent (Kueue's, the PodGroups) or whose events are rare. Written here because no
well-kept Python library has an informer: the official client's `watch.Watch` streams one
request, and neither lists, nor lists again after a 410, nor reports what went meanwhile.

    watches = Watches(patterns, watched, loop, synced)  # `trainop operator -n` patterns; [] = all
    watches.start()              # threads; each change reaches its cache in the loop
    await synced.wait()          # every first list is in
    watches.stop()

Each `Informer` lists its path (a consistent read), hands the whole list to the cache (which
turns it into the changes since its last view: pods gone while the watch was away are reported
deleted), then watches from the list's resourceVersion with bookmarks, from the last version it
saw when a watch ends, and lists again when the API server says that version is gone (410).
A broken connection or an API server away is retried after the same waits as kopf's
(main.py: at most 5 s apart): a WARNING when it starts, an INFO when it is back, nothing between.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import urllib3
from kopf._cogs.structs.references import match_namespace
from kubernetes.client.exceptions import ApiException

from trainop import kube

log = logging.getLogger("trainop.informer")
SERVER_TIMEOUT = 300  # seconds a watch request lasts (kopf's, main.py)
BACKOFFS = (1, 1, 2, 2, 3, 3, 5)  # seconds between tries while the API server is away (then 5)


class Informer:
    """One path's list and watch in a daemon thread. `on_list(items)` and `on_event(type,
    obj)` run in `loop`, in the order the API server sent them; nothing after stop()."""

    def __init__(self, path: str, kind: str, loop: asyncio.AbstractEventLoop, on_list, on_event,
                 *, selector: str | None = None, resource_version: str | None = None) -> None:
        self.path, self.kind, self.loop, self.selector = path, kind, loop, selector
        self.on_list, self.on_event = on_list, on_event
        self.resource_version = resource_version  # None: list first
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"trainop-watch {path}", daemon=True)

    def start(self) -> Informer:
        self.thread.start()
        return self

    def stop(self) -> None:
        """No more calls into the loop (a watch blocked on its socket ends with its timeout)."""
        self.stopped.set()

    def _call(self, fn, *args) -> None:
        if not self.stopped.is_set():
            try:
                self.loop.call_soon_threadsafe(self._guarded, fn, args)
            except RuntimeError:  # the loop is closed: the operator is stopping
                self.stopped.set()

    def _guarded(self, fn, args) -> None:
        if not self.stopped.is_set():  # (stopped while this call waited in the loop)
            fn(*args)

    def _run(self) -> None:
        failures = 0
        while not self.stopped.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                for event in kube.watch(self.path, self.resource_version, SERVER_TIMEOUT,
                                        self.selector):
                    if self.stopped.is_set():
                        return
                    failures = self._back(failures)
                    self._event(event)
                failures = self._back(failures)
            except ApiException as exc:
                if exc.status == 410:  # compacted, or older than the watch cache: list again
                    self.resource_version = None
                    continue
                failures = self._failed(failures, f"{exc.status} {exc.reason}")
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                failures = self._failed(failures, repr(exc))
            except Exception:  # a bug, or an answer garbled: said, and listed again, never a
                # watch that ends in silence
                log.exception("watching %s failed; listing again", self.path)
                self.resource_version = None
                failures = self._failed(max(failures, 1), "")

    def _list(self) -> None:
        listed = kube.request("GET", self.path,
                              query=[("labelSelector", self.selector)] if self.selector else None)
        for item in listed.get("items") or []:  # a list's items leave these out
            item.setdefault("apiVersion", listed.get("apiVersion", "v1"))
            item.setdefault("kind", self.kind)
        self.resource_version = listed["metadata"]["resourceVersion"]
        self._call(self.on_list, listed.get("items") or [])

    def _event(self, event: dict) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # a Status: 410 Gone for a version the server no longer has
            raise ApiException(status=obj.get("code"), reason=obj.get("reason") or obj.get("message"))
        self.resource_version = obj["metadata"]["resourceVersion"]
        if kind != "BOOKMARK":  # (a bookmark only moves the version on)
            self._call(self.on_event, kind, obj)

    def _back(self, failures: int) -> int:
        if failures:
            log.info("watching %s again", self.path)
        return 0

    def _failed(self, failures: int, reason: str) -> int:
        if self.stopped.is_set():  # (a watch ended by the stop, or the cluster going with it)
            return failures
        if not failures:  # the API server away (a restart, an upgrade): said once
            log.warning("watching %s failed (%s); retrying", self.path, reason)
        self.stopped.wait(BACKOFFS[min(failures, len(BACKOFFS) - 1)])
        return failures + 1


def _match(name: str, patterns: list[str]) -> bool:
    # kopf's own matcher, so that these kinds are watched in exactly the namespaces kopf watches
    # the others in (globs, "!"-exclusions, comma-separated parts)
    return any(match_namespace(name, p) for p in patterns)


def plain(patterns: list[str]) -> bool:
    """Namespace names only, no pattern (kopf's select_specific_namespaces' rule)."""
    return all(not any(c in p for c in "!*?,") for p in patterns)


class Watches:
    """The operator's own watches (handlers/caches.py's WATCHED: (apiVersion, kind, label
    selector, cache)) in the namespaces `trainop operator` serves: cluster-wide (no -n), in each
    namespace named, or, for patterns, in each matching namespace as namespaces come and go (a
    watch of Namespaces, as kopf keeps for the other kinds). `synced` is set when every first
    list is in."""

    def __init__(self, patterns: list[str], watched, loop: asyncio.AbstractEventLoop,
                 synced: asyncio.Event) -> None:
        self.patterns, self.watched, self.loop, self.synced = list(patterns), list(watched), loop, synced
        self.watches: dict[str | None, list[Informer]] = {}  # namespace (None: all) -> its watches
        self.pending: set[tuple[str | None, str]] = set()  # (namespace, kind) not listed yet
        self.namespaces: Informer | None = None
        self.namespaces_listed = False

    def start(self) -> None:
        if not self.patterns:
            self._watch(None)
        elif plain(self.patterns):
            for ns in self.patterns:
                self._watch(ns)
        else:
            self.namespaces = Informer("/api/v1/namespaces", "Namespace", self.loop,
                                       self._namespaces_listed, self._namespace_event).start()

    def stop(self) -> None:
        for informer in [*(i for group in self.watches.values() for i in group), self.namespaces]:
            if informer is not None:
                informer.stop()

    def _watch(self, ns: str | None) -> None:
        self.watches[ns] = []
        for api_version, kind, selector, cache in self.watched:
            self.pending.add((ns, kind))

            def listed(items, ns=ns, kind=kind, cache=cache):
                cache.replace(ns, items, kind)
                self.pending.discard((ns, kind))
                self._check_synced()

            self.watches[ns].append(Informer(kube.path(api_version, kind, ns), kind, self.loop,
                                             listed, cache.observe, selector=selector).start())

    def _check_synced(self) -> None:
        if not self.pending and (self.namespaces is None or self.namespaces_listed):
            self.synced.set()

    def _unwatch(self, ns: str) -> None:
        for informer in self.watches.pop(ns):
            informer.stop()
        for _, kind, _, cache in self.watched:
            self.pending.discard((ns, kind))
            cache.replace(ns, [], kind)  # (its objects went with it)

    def _namespaces_listed(self, items: list[dict]) -> None:
        names = {i["metadata"]["name"] for i in items if _match(i["metadata"]["name"], self.patterns)}
        for ns in names - set(self.watches):
            self._watch(ns)
        for ns in set(self.watches) - names:
            self._unwatch(ns)
        self.namespaces_listed = True
        self._check_synced()

    def _namespace_event(self, kind: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED" and name in self.watches:
            self._unwatch(name)
        elif kind != "DELETED" and name not in self.watches and _match(name, self.patterns):
            self._watch(name)
