"""List, then watch, one kind of Kubernetes object: the loop every Kubernetes source shares.

Client: kubernetes-asyncio. Its watch takes `resource_version` and `allow_watch_bookmarks`,
keeps the version from every event and BOOKMARK, and raises `ApiException(410)` for an expired
version (the ERROR event), so the list-then-watch loop below stays explicit. Config: the pod's
service account in a cluster, else `kubeconfig:` or `KUBECONFIG`. What a change means is the
`Resource`'s (kubernetes.py: EndpointSlices; inferencepool.py: the pool and its pods).

    list (resourceVersion R) -> watch from R with bookmarks -> events update the set
    a bookmark with more of the stream already here behind it -> superseded: skipped (only the
                                latest version matters), neither applied nor counted as a sign
                                of being in sync: a flood's backlog is read through at once
    410 Gone                 -> re-list at once; a second 410 in a row waits (backoff) first
    non-2xx list or watch    -> the last set stays, the source is stale ("HTTP 429"), backoff
    no event for `watch_idle_timeout` -> the watch is restarted; the source is stale meanwhile
                                (superseded bookmarks are no event: a backlog that does not
                                end within it shows stale, and the watch resumes past it)
    watch closed / dropped   -> watch again from the last version (backoff with jitter on
                                errors; only a watch that stayed up resets it)
    every `resync` seconds   -> full re-list and reconcile, even when the watch looks fine:
                                this is what catches a DELETE lost while the watch was down
    API server unreachable   -> the last set stays (never emptied); the source is stale
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from router.core.settings import KubernetesWatch
from router.discovery.reconcile import Reconciler

_LIST_TIMEOUT = 10.0
_MAX_LIST_BYTES = 256 * 1024 * 1024  # a list answer past this is not one source's objects
_BACKOFF_BASE = 0.2
_HEALTHY = 10.0  # seconds a watch must stay up before the backoff starts over
_BOOKMARKS_PER_S = 20  # more in a second is a flood: warned, and worked through at half pace
_SLICE = 0.005  # seconds of watch events handled between yields to the loop (a backlog's)
_MAX_LINE = 4 * 1024 * 1024  # one watch event's JSON at most (the client's own line limit)
# A bookmark's line as the API server writes it (Go's encoding/json: `type` first). Another
# spelling is parsed, and still skipped when superseded.
_BOOKMARK = re.compile(rb'\{\s*"type"\s*:\s*"BOOKMARK"')
_SUPERSEDED: dict[str, Any] = {"type": "BOOKMARK"}  # what a skipped bookmark reads as
_YIELD_BYTES = 1 << 20  # list JSON decoded between yields

Lister = tuple[Callable[..., Awaitable[Any]], tuple[Any, ...], dict[str, Any]]


class Resource(Protocol):
    """One kind of object a `ListWatch` follows, and what its changes mean to the source."""

    def lister(self, client: Any) -> Lister:
        """The client's list function for this kind, its positional arguments and its
        selectors (the watch is the same call with `watch=True`)."""
        ...

    async def listed(self, items: dict[str, dict[str, Any]]) -> None:
        """A whole list, by object name: objects not named are gone."""
        ...

    def read(self, kind: str, name: str, obj: dict[str, Any]) -> Any:
        """A watch event (ADDED, MODIFIED, DELETED) as the change to apply; None: nothing."""
        ...

    async def apply(self, change: Any) -> None: ...


class ListWatch:
    def __init__(
        self,
        cfg: KubernetesWatch,
        reconciler: Reconciler,
        resource: Resource,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.rec = reconciler
        self.resource = resource
        self._clock = clock
        self._failures = 0  # failed rounds since the watch was last healthy (the backoff)
        self._rng = random.Random()
        self._bookmark_window = 0.0
        self._bookmarks = 0
        self._slice_start = 0.0  # when the watch last yielded the loop
        self._superseded = 0  # bookmarks skipped, not yet counted
        # The client's import takes ~0.3 s (hundreds of model modules): here, at startup, not
        # in the running loop on the source's first round.
        import kubernetes_asyncio.client
        import kubernetes_asyncio.watch  # noqa: F401

    async def _client(self) -> Any:
        from kubernetes_asyncio import client, config

        # In a pod (the variable Kubernetes sets) the service account; elsewhere a kubeconfig.
        if self.cfg.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return client.ApiClient()
        conf = client.Configuration()
        await config.load_kube_config(config_file=self.cfg.kubeconfig, client_configuration=conf)
        return client.ApiClient(configuration=conf)

    async def run(self) -> None:
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.config import ConfigException

        api: Any = None
        version: str | None = None
        next_list = 0.0
        idle = self.cfg.watch_idle_timeout
        try:
            while True:
                started = self._clock()
                try:
                    if api is None:
                        api = await self._client()
                    if version is None or self._clock() >= next_list:
                        version = await self._list(api)
                        next_list = self._clock() + self.cfg.resync
                    remaining = max(1, int(next_list - self._clock()))
                    func, args, selectors = self.resource.lister(api)
                    w = _raw_watch()
                    try:
                        # No event and no bookmark for `idle` seconds: the watch is hung (or
                        # dripping); restart it, and say so meanwhile.
                        async with asyncio.timeout(idle) as quiet:
                            async for ev in w.stream(
                                func,
                                *args,
                                **selectors,
                                resource_version=version,
                                allow_watch_bookmarks=True,
                                timeout_seconds=remaining,
                                _request_timeout=remaining + _LIST_TIMEOUT,
                            ):
                                version = w.resource_version or version
                                bookmark = ev.get("type") == "BOOKMARK"
                                if bookmark and w.behind:
                                    # Superseded: later lines are here already (a flood's
                                    # backlog); only the latest version matters.
                                    self._superseded += 1
                                    del ev
                                    await self._turn(True)
                                    continue
                                quiet.reschedule(asyncio.get_running_loop().time() + idle)
                                change = self._read_event(ev)
                                # The event's JSON (thousands of objects for a large slice)
                                # goes before the apply, not after: kept through it, the
                                # collector moves it to its old generation and then runs
                                # full collections for it.
                                del ev
                                if change is not None:
                                    await self.resource.apply(change)
                                await self._turn(bookmark)
                                if self._clock() - started >= _HEALTHY:
                                    self._failures = 0
                    except TimeoutError:
                        if quiet.expired():
                            self.rec.failed("watch_idle", f"no watch event for {idle:g}s")
                            await self._pause()
                            continue
                        raise
                    finally:
                        self._count_superseded()
                        await w.close()
                    # Closed by the server (its timeout, or a restart): watch again from
                    # `version`; a watch that keeps closing at once is slowed down.
                    if self._clock() - started < 1.0:
                        await self._pause()
                except ApiException as exc:
                    if exc.status == 410:
                        self.rec.event("expired")
                        version = None  # too old to resume: re-list
                        if self._failures == 0:
                            self._failures = 1  # at once the first time; a second 410 waits
                            continue
                        self.rec.failed("expired", "HTTP 410")
                        await self._pause()
                        continue
                    self.rec.failed("error", f"HTTP {exc.status}")
                    if exc.status in (401, 403, 404):
                        version = None
                    if exc.status == 401 and api is not None:
                        # An expired token (exec plugins, rotated service-account tokens):
                        # read the config again before the next try.
                        await api.close()
                        api = None
                    await self._pause()
                except ConfigException as exc:
                    self.rec.failed("error", f"kubeconfig: {type(exc).__name__}")
                    api = None
                    await self._pause()
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    self.rec.failed("error", type(exc).__name__)
                    version = None if isinstance(exc, ValueError) else version
                    await self._pause()
                except (KeyError, TypeError, AttributeError, Exception) as exc:
                    # The client raises a bare Exception for a malformed watch line; whatever
                    # the API server answered, keep the last set and start over with a list.
                    self.rec.failed("bad_answer", type(exc).__name__)
                    version = None
                    await self._pause()
        finally:
            if api is not None:
                await api.close()

    async def _pause(self) -> None:
        """Exponential backoff with full jitter (AWS's "full jitter"), capped at `backoff_max`.
        Only a watch that stayed up for `_HEALTHY` seconds resets it, never a good list: a
        server that answers lists but breaks every watch must not get a list storm."""
        cap = min(self.cfg.backoff_max, _BACKOFF_BASE * 2**self._failures)
        self._failures = min(self._failures + 1, 30)
        await asyncio.sleep(self._rng.uniform(cap / 2, cap))

    async def _turn(self, bookmark: bool) -> None:
        """After each watch event: a backlog (thousands of changes, a flood of bookmarks) is
        worked through in slices of `_SLICE` seconds, each followed by a turn of the loop, so
        requests keep theirs. Bookmarks come about once a minute; more than `_BOOKMARKS_PER_S`
        in a second is the server's fault: warned, and each slice of it is followed by a rest
        as long, so a flood costs at most half the loop and still drains in seconds (pacing
        each bookmark instead left 82,000 of them, and the changes behind them, an hour)."""
        now = self._clock()
        flooding = False
        if bookmark:
            if now - self._bookmark_window >= 1.0:
                self._bookmark_window, self._bookmarks = now, 0
            self._bookmarks += 1
            flooding = self._bookmarks > _BOOKMARKS_PER_S
            if self._bookmarks == _BOOKMARKS_PER_S + 1:
                self.rec.warn("bookmark_flood", "the API server floods the watch with bookmarks")
        if now - self._slice_start < _SLICE:
            return
        self._count_superseded()
        await asyncio.sleep(_SLICE if flooding else 0)
        self._slice_start = self._clock()

    def _count_superseded(self) -> None:
        if self._superseded:
            self.rec.event("bookmark_superseded", self._superseded)
            self._superseded = 0

    async def _list(self, api: Any) -> str:
        from kubernetes_asyncio.client.exceptions import ApiException

        func, args, selectors = self.resource.lister(api)
        resp = await func(
            *args, **selectors, _preload_content=False, _request_timeout=_LIST_TIMEOUT
        )
        # Raw answers skip the client's status check: a 429/410/500 Status body has no items
        # and must never read as "no objects" (that would empty the fleet).
        if not 200 <= resp.status <= 299:
            resp.release()
            raise ApiException(status=resp.status, reason="list failed")
        # read(n) returns what has arrived, up to n: a large list comes in many reads.
        raw = bytearray()
        while chunk := await resp.content.read(_MAX_LIST_BYTES + 1 - len(raw)):
            raw += chunk
            if len(raw) > _MAX_LIST_BYTES:
                resp.release()
                raise ValueError("list answer too large")
        body = await _decode_list(raw.decode("utf-8"))
        items = body.get("items")
        meta = body.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if not isinstance(items, list) or not isinstance(rv, str) or not rv:
            raise ValueError("not a list answer")
        named = {
            item["metadata"]["name"]: item
            for item in items
            if isinstance(item, dict)
            and isinstance(item.get("metadata"), dict)
            and isinstance(item["metadata"].get("name"), str)
            and item["metadata"]["name"]
        }
        self.rec.event("relist")
        del raw, body, items  # the JSON goes before the apply, not after it
        await self.resource.listed(named)
        return rv

    async def event(self, ev: dict[str, Any]) -> None:
        """One watch event, read and applied."""
        change = self._read_event(ev)
        if change is not None:
            await self.resource.apply(change)

    def _read_event(self, ev: dict[str, Any]) -> Any:
        """A watch event as the resource's change, or None when it changes nothing (a
        bookmark, a bad event)."""
        kind = ev.get("type")
        if kind == "BOOKMARK":
            self.rec.event("bookmark")
            self.rec.synced()
            return None
        obj = ev.get("raw_object")
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(obj, dict) or not isinstance(name, str) or not name:
            self.rec.warn("bad_answer", "ignoring a watch event without an object name")
            return None
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return None
        self.rec.event("watch_" + kind.lower())
        return self.resource.read(kind, name, obj)


def _raw_watch() -> Any:
    from kubernetes_asyncio import watch

    class RawWatch(watch.Watch):
        """Events as the JSON dicts the server sent: the client would also build its model
        objects (a few ms per 1,000-endpoint slice, in Python), which nothing here reads.

        Lines are read as they have arrived, all at once (the client reads one at a time), so
        `behind` tells whether more of the stream is already here after the event returned: a
        bookmark then is superseded. A line is at most `_MAX_LINE` bytes."""

        def __init__(self) -> None:
            super().__init__()
            self._lines: deque[bytes] = deque()
            self._rest = bytearray()  # a line begun, not ended
            self.behind = False

        def unmarshal_event(self, data: str | bytes, response_type: str | None) -> Any:
            return super().unmarshal_event(data, None)

        async def next(self) -> Any:
            # The client's own, for a watch with `timeout_seconds` (it ends with the stream).
            resp: Any = self.resp
            if resp is None:
                resp = self.resp = await self.func()
            content = resp.content
            lines, rest = self._lines, self._rest
            while not lines:
                data = await content.readany()
                if not data:  # the end: a last line without its LF still counts
                    if not rest:
                        raise StopAsyncIteration
                    lines.append(bytes(rest))
                    rest.clear()
                    break
                start = len(rest)
                rest += data
                rest += content.read_nowait()
                end = rest.rfind(b"\n", start)
                if end >= 0:
                    lines.extend(line for line in bytes(rest[:end]).split(b"\n") if line)
                    del rest[: end + 1]
                if len(rest) > _MAX_LINE:
                    raise ValueError("a watch event is too long")
            line = lines.popleft()
            self.behind = bool(lines or rest)
            if self.behind and _BOOKMARK.match(line):
                return _SUPERSEDED  # not parsed: its version is not needed either
            return self.unmarshal_event(line.decode("utf8"), self.return_type)

    return RawWatch()


async def _decode_list(text: str) -> dict[str, Any]:
    """A list answer, decoded one item at a time and yielding to the loop every few MB: a
    50,000 endpoint list is tens of MB of JSON, and one `json.loads` of it would hold the loop
    for far longer than a request may wait. Each value is decoded by the standard decoder."""
    dec = json.JSONDecoder()
    ws = re.compile(r"[ \t\n\r]*")
    out: dict[str, Any] = {}

    def skip(i: int) -> int:
        m = ws.match(text, i)
        return m.end() if m else i

    def expect(i: int, ch: str) -> int:
        i = skip(i)
        if text[i : i + 1] != ch:
            raise ValueError("not a list answer")
        return i + 1

    i = expect(0, "{")
    if text[skip(i) : skip(i) + 1] == "}":
        return out
    since = 0
    while True:
        key, i = dec.raw_decode(text, skip(i))
        i = expect(i, ":")
        i = skip(i)
        if key == "items" and text[i : i + 1] == "[":
            items: list[Any] = []
            i = skip(i + 1)
            if text[i : i + 1] == "]":
                i += 1
            else:
                while True:
                    start = i
                    item, i = dec.raw_decode(text, skip(i))
                    items.append(item)
                    since += i - start
                    if since >= _YIELD_BYTES:
                        since = 0
                        await asyncio.sleep(0)
                    i = skip(i)
                    if text[i : i + 1] == "]":
                        i += 1
                        break
                    i = expect(i, ",")
            value: Any = items
        else:
            value, i = dec.raw_decode(text, i)
        if isinstance(key, str):
            out[key] = value
        i = skip(i)
        if text[i : i + 1] == "}":
            return out
        i = expect(i, ",")
