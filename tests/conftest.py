from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import Cluster
from tests.hostile_backend import HostileBackend


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
