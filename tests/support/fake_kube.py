"""A small Kubernetes API server for the tests, on a loopback port: EndpointSlices, Pods and
InferencePools (the Gateway API Inference Extension's CRD, `inference.networking.k8s.io/v1`).

It speaks the real wire protocol the client library uses:

    GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v
    GET /api/v1/namespaces/{ns}/pods?labelSelector=k=v,k2=v2
    GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools
        ?fieldSelector=metadata.name=NAME
        -> <Kind>List with metadata.resourceVersion
    ...&watch=true&resourceVersion=R[&allowWatchBookmarks=true][&timeoutSeconds=N]
        -> a chunked stream of JSON lines {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, ...}
           with every change after R, then live changes; R older than the retained history
           -> an ERROR event carrying a 410 Gone Status, and the stream ends

One resourceVersion sequence and one history for every resource, as a real server has (etcd's
revision). Test controls (thread-safe, from the test's thread): `put_slice`, `delete_slice`,
`put_pod`, `delete_pod`, `put_pool`, `delete_pool` (each may be `silent`: the change is not in
the watch history, as an event lost while a watch reconnects), `drop_watches`, `expire` (forget
the history: resuming watches get 410), `down` / `up` (the server stops answering and accepting,
then comes back on the same port). `calls` records (verb, resource, selector) per request.

What it does not model: authentication and RBAC (the bearer token is accepted, not checked),
set-based label selectors, field selectors other than `metadata.name`/`metadata.namespace`,
pagination (`limit`/`continue`), other resources, protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from tests.support.harness import Proc, free_port

# Path prefix -> (resource, its kind, its apiVersion).
_RESOURCES = {
    "/apis/discovery.k8s.io/v1/namespaces/": (
        "endpointslices",
        "EndpointSlice",
        "discovery.k8s.io/v1",
    ),
    "/api/v1/namespaces/": ("pods", "Pod", "v1"),
    "/apis/inference.networking.k8s.io/v1/namespaces/": (
        "inferencepools",
        "InferencePool",
        "inference.networking.k8s.io/v1",
    ),
}
_KINDS = {r: (kind, version) for r, kind, version in _RESOURCES.values()}


def endpoint(
    address: str, ready: bool = True, serving: bool | None = None, terminating: bool = False
) -> dict[str, Any]:
    return {
        "addresses": [address],
        "conditions": {
            "ready": ready,
            "serving": ready if serving is None else serving,
            "terminating": terminating,
        },
    }


def mock_host(mock: Proc) -> str:
    return mock.url.split("//")[1].split(":")[0]


def put_mock(kube: FakeKube, mock: Proc, name: str, silent: bool = False, **cond: Any) -> None:
    """One slice per mock (a Service's endpoints may spread over several slices), at the mock's
    own address and port."""
    ports = [{"name": "http", "port": mock.port}]
    kube.put_slice(name, [endpoint(mock_host(mock), **cond)], ports, silent=silent)


def kube_source(kube: FakeKube, kubeconfig: Path, **extra: Any) -> dict[str, Any]:
    """A `kind: kubernetes` discovery source for the fake's Service `models/vllm` (port `http`,
    `models: auto`), its kubeconfig written to `kubeconfig`."""
    return {
        "kind": "kubernetes",
        "namespace": "models",
        "service": "vllm",
        "port": "http",
        "models": "auto",
        "backoff_max": 0.5,
        "kubeconfig": str(kube.kubeconfig(kubeconfig)),
        **extra,
    }


class FakeKube:
    def __init__(self, port: int, bookmark_every: float = 0.5) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.bookmark_every = bookmark_every
        self.rv = 100
        # resource -> (namespace, name) -> object
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {r: {} for r in _KINDS}
        self.slices = self.objects["endpointslices"]
        # rv, resource, type, the object, and the object before (a selector's watch turns a
        # change into or out of the selection into ADDED or DELETED, as the API server does)
        self.history: list[tuple[int, str, str, dict[str, Any], dict[str, Any] | None]] = []
        self.oldest = 0  # a watch from a version below this gets 410
        self.requests: list[str] = []  # "list" | "watch" | "410", in order
        self.calls: list[tuple[str, str, str]] = []  # (list | watch, resource, selectors)
        # Hostile answers (set from the test): lists answer this status; watches answer this
        # status (410: an ERROR event, as a real server does); watches send one malformed line;
        # watches stay silent (no events, no bookmarks); watches flood bookmarks.
        self.list_error: int | None = None
        self.watch_error: int | None = None
        self.watch_garbage = False
        self.silent = False
        # This many bookmarks back to back (one write) at the start of each watch.
        self.bookmark_flood = 0
        self._changed: asyncio.Condition | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start())

    # -- test controls -------------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def put_slice(
        self,
        name: str,
        endpoints: list[dict[str, Any]],
        ports: list[dict[str, Any]],
        service: str = "vllm",
        namespace: str = "models",
        silent: bool = False,
    ) -> None:
        labels = {"kubernetes.io/service-name": service}
        body = {"addressType": "IPv4", "endpoints": endpoints, "ports": ports}
        self.put("endpointslices", namespace, name, labels, body, silent)

    def delete_slice(self, name: str, namespace: str = "models", silent: bool = False) -> None:
        self.delete("endpointslices", namespace, name, silent)

    def put_pod(
        self,
        name: str,
        ip: str | None,
        labels: dict[str, str],
        ready: bool = True,
        terminating: bool = False,
        namespace: str = "models",
        silent: bool = False,
    ) -> None:
        """A pod as the kubelet reports it: `Ready` among its conditions, its IP once it has
        one, a `deletionTimestamp` once it is terminating."""
        status: dict[str, Any] = {
            "phase": "Running" if ip else "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        }
        if ip:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        body = {"spec": {"containers": [{"name": "vllm", "image": "vllm"}]}, "status": status}
        meta = {"deletionTimestamp": "2026-01-01T00:00:00Z"} if terminating else {}
        self.put("pods", namespace, name, labels, body, silent, meta)

    def delete_pod(self, name: str, namespace: str = "models", silent: bool = False) -> None:
        self.delete("pods", namespace, name, silent)

    def put_pool(
        self,
        name: str,
        match_labels: dict[str, str],
        ports: list[int],
        namespace: str = "models",
        picker: str = "epp",
        silent: bool = False,
    ) -> None:
        """An InferencePool (v1): its pods by `matchLabels`, `targetPorts`, its picker."""
        spec = {
            "selector": {"matchLabels": match_labels},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": picker, "port": {"number": 9002}},
        }
        self.put("inferencepools", namespace, name, {}, {"spec": spec}, silent)

    def delete_pool(self, name: str, namespace: str = "models", silent: bool = False) -> None:
        self.delete("inferencepools", namespace, name, silent)

    def put(
        self,
        resource: str,
        namespace: str,
        name: str,
        labels: dict[str, str],
        body: dict[str, Any],
        silent: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        async def put() -> None:
            key = (namespace, name)
            prev = self.objects[resource].get(key)
            kind = "ADDED" if prev is None else "MODIFIED"
            self.rv += 1
            obj_kind, version = _KINDS[resource]
            obj = {
                "kind": obj_kind,
                "apiVersion": version,
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "resourceVersion": str(self.rv),
                    "labels": labels,
                    **(meta or {}),
                },
                **body,
            }
            self.objects[resource][key] = obj
            await self._record(resource, kind, obj, silent, prev)

        self._call(put())

    def delete(self, resource: str, namespace: str, name: str, silent: bool = False) -> None:
        async def delete() -> None:
            obj = self.objects[resource].pop((namespace, name))
            self.rv += 1
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
            await self._record(resource, "DELETED", obj, silent)

        self._call(delete())

    def drop_watches(self) -> None:
        self._call(self._drop())

    def expire(self) -> None:
        """Compact the history: a watch resuming from any version seen so far gets 410."""

        async def expire() -> None:
            self.history.clear()
            self.oldest = self.rv + 1

        self._call(expire())

    def down(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            await self._drop()
            await self._server.wait_closed()
            self._server = None

        self._call(stop())

    def up(self) -> None:
        if self._server is None:
            self._call(self._start())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._server is not None:
                self.down()

        async def cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._call(cancel_rest())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "fake-token"}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "tester"}}
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    # -- the server ----------------------------------------------------------------------------

    async def _start(self) -> None:
        self._changed = self._changed or asyncio.Condition()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _drop(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _record(
        self,
        resource: str,
        kind: str,
        obj: dict[str, Any],
        silent: bool,
        prev: dict[str, Any] | None = None,
    ) -> None:
        if not silent:
            self.history.append((self.rv, resource, kind, obj, prev))
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                url = urlsplit(target)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                ns, resource = "", ""
                for prefix in _RESOURCES:
                    if url.path.startswith(prefix):
                        ns, _, resource = url.path[len(prefix) :].partition("/")
                        if resource != _RESOURCES[prefix][0]:
                            resource = ""
                        break
                if method != "GET" or not resource:
                    await self._send(writer, 404, _status(404, "NotFound", "not found"))
                    continue
                match = _Match(query)
                verb = "watch" if _true(query.get("watch")) else "list"
                self.calls.append((verb, resource, match.text))
                if verb == "watch":
                    await self._watch(writer, resource, ns, match, query)
                    return  # a watch stream ends its connection
                self.requests.append("list")
                if self.list_error is not None:
                    code = self.list_error
                    await self._send(writer, code, _status(code, "Failure", "hostile"))
                    continue
                items = [o for (n, _), o in sorted(self.objects[resource].items()) if n == ns]
                kind, version = _KINDS[resource]
                body = {
                    "kind": kind + "List",
                    "apiVersion": version,
                    "metadata": {"resourceVersion": str(self.rv)},
                    "items": [o for o in items if match(o)],
                }
                await self._send(writer, 200, body)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        except asyncio.CancelledError:
            return  # close(): the connection's task ends quietly (3.11 logs a cancelled one)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def _watch(
        self,
        writer: asyncio.StreamWriter,
        resource: str,
        ns: str,
        match: _Match,
        query: dict[str, str],
    ) -> None:
        self.requests.append("watch")
        if self.watch_error is not None and self.watch_error != 410:
            code = self.watch_error
            await self._send(writer, code, _status(code, "Failure", "hostile"))
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )

        async def event(kind: str, obj: dict[str, Any]) -> None:
            data = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        if self.watch_garbage:
            data = b"{not json at all\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            await writer.drain()
            return
        # A watch from version R gets every change after R, R = "0" included (the version an
        # empty list answers): a change made between that list and this watch is not lost.
        given = query.get("resourceVersion")
        since = int(given or 0)
        if (since and since < self.oldest) or self.watch_error == 410:
            self.requests.append("410")
            await event("ERROR", _status(410, "Expired", f"too old resource version: {since}"))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        bookmarks = _true(query.get("allowWatchBookmarks"))
        end = time.monotonic() + float(query.get("timeoutSeconds") or 3600)
        kind, version = _KINDS[resource]
        mark = {"kind": kind, "apiVersion": version}
        sent = since if given else self.rv
        if bookmarks and self.bookmark_flood:
            # Back to back, in one write (a backlog), each at the version this watch has
            # delivered so far, as a real server's bookmarks are: the changes after it follow.
            meta = {"resourceVersion": str(sent)}
            line = json.dumps({"type": "BOOKMARK", "object": {**mark, "metadata": meta}})
            data = (line.encode() + b"\n") * self.bookmark_flood
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        assert self._changed is not None
        while time.monotonic() < end:
            for rv, res, change, obj, prev in list(self.history):
                if self.silent:
                    break
                if rv > sent and res == resource and obj["metadata"]["namespace"] == ns:
                    seen = _seen(change, match(obj), prev is not None and match(prev))
                    if seen is not None:
                        await event(seen, obj)
                sent = max(sent, rv)
            sent = max(sent, self.rv)
            wait = min(self.bookmark_every, end - time.monotonic())
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), max(wait, 0.01))
                    continue
                except TimeoutError:
                    pass
            if bookmarks and not self.silent:
                await event("BOOKMARK", {**mark, "metadata": {"resourceVersion": str(self.rv)}})
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@contextlib.contextmanager
def serving(bookmark_every: float = 0.3) -> Iterator[FakeKube]:
    """A FakeKube on a free loopback port, closed on the way out (the suites' `kube` fixtures)."""
    fk = FakeKube(free_port(), bookmark_every=bookmark_every)
    try:
        yield fk
    finally:
        fk.close()


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _true(value: str | None) -> bool:
    # What the API server's Go code accepts (strconv.ParseBool); the Python client sends "True".
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _seen(change: str, matches: bool, matched: bool) -> str | None:
    """What a watch with a selector says of a change: a MODIFIED that moves the object into
    the selection is ADDED, one that moves it out DELETED; None: not seen."""
    if change != "MODIFIED":
        return change if matches else None
    if matches:
        return "MODIFIED" if matched else "ADDED"
    return "DELETED" if matched else None


class _Match:
    """A request's label and field selectors (equality only), as one test of an object."""

    def __init__(self, query: dict[str, str]) -> None:
        self.labels = _pairs(query.get("labelSelector", ""))
        self.fields = _pairs(query.get("fieldSelector", ""))
        self.text = ";".join(query.get(k, "") for k in ("labelSelector", "fieldSelector"))

    def __call__(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"]}
        return all(labels.get(k) == v for k, v in self.labels.items()) and all(
            fields.get(k) == v for k, v in self.fields.items()
        )


def _pairs(text: str) -> dict[str, str]:
    pairs = (p.split("=", 1) for p in text.split(",") if "=" in p)
    return {k.strip(): v.strip().lstrip("=") for k, v in pairs}
