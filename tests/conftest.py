from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.fake_kube import FakeKube
from tests.support.harness import Cluster, free_port
from tests.support.hostile_backend import HostileBackend
from tests.support.otlp_receiver import Receiver


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
    fk = FakeKube(free_port(), bookmark_every=0.3)
    try:
        yield fk
    finally:
        fk.close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """A fake OTLP/HTTP collector the router's exporter sends its spans to."""
    r = Receiver().start()
    try:
        yield r
    finally:
        r.close()
