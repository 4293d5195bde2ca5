from __future__ import annotations

import ast
import ssl
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import cast

import httpx._transports.default
import httpx2._transports.default
import pytest

from tests.support.fake_kube import FakeKube, serving
from tests.support.harness import Cluster
from tests.support.hostile_backend import HostileBackend
from tests.support.otlp_receiver import Receiver


# Every httpx client (each `httpx.get`/`post`, each poll of `wait_http` and of the checks
# `wait_for` runs every 20 ms) and every SDK client (openai and anthropic are built on httpx2)
# builds the default SSL context from the CA bundle: ~35 ms of CPU against ~2 ms for the
# plain-HTTP loopback request itself, paid thousands of times a run. The default context is built
# once per library and shared (the suite's TLS tests pass their own `verify`, built as asked).
def _share_default_ssl_context(transports: ModuleType) -> None:
    build = transports.create_ssl_context
    shared = build()

    def create_ssl_context(
        verify: ssl.SSLContext | str | bool = True, cert: object = None, trust_env: bool = True
    ) -> ssl.SSLContext:
        if verify is True and cert is None:
            return cast(ssl.SSLContext, shared)
        return cast(ssl.SSLContext, build(verify=verify, cert=cert, trust_env=trust_env))

    transports.create_ssl_context = create_ssl_context


_share_default_ssl_context(httpx._transports.default)
_share_default_ssl_context(httpx2._transports.default)


# CPython before 3.11.8 keeps `ast.parse`'s recursion-depth count per interpreter, not per thread
# (cpython gh-106905): two threads parsing at once (pytest rendering a failure's source while a
# test's thread prints a traceback, whose carets parse the line) raise a spurious
# `SystemError: AST constructor recursion depth mismatch`. Seen in loaded runs, in the layer
# test and in pytest's own failure report (a worker crashed, its tests lost). Parses take turns,
# and one that still meets the error is parsed again.
def _parse_in_turn() -> None:
    parse = ast.parse
    turn = threading.RLock()

    def parse_in_turn(*args: object, **kwargs: object) -> ast.AST:
        with turn:
            try:
                return parse(*args, **kwargs)  # type: ignore[arg-type]
            except SystemError:
                return parse(*args, **kwargs)  # type: ignore[arg-type]

    ast.parse = parse_in_turn  # type: ignore[assignment]


if sys.version_info < (3, 11, 8):
    _parse_in_turn()


@pytest.fixture
def procs() -> Iterator[Cluster]:
    """Processes started by one test, stopped when it ends."""
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def module_procs() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileBackend]:
    """The raw-socket backend that misbehaves in the way each model name asks for."""
    h = HostileBackend().start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    """A fake Kubernetes API server (EndpointSlices, watches, bookmarks) for a module's tests."""
    with serving() as fk:
        yield fk


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """A fake OTLP/HTTP collector the router's exporter sends its spans to."""
    r = Receiver().start()
    try:
        yield r
    finally:
        r.close()
