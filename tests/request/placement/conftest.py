"""The placement tests' shared prefill/decode engines."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.request.placement.test_disaggregation import TOKENS, pd_mock, pd_router
from tests.support.harness import Cluster, Proc, control


@pytest.fixture(scope="module")
def shared_pd(module_procs: Cluster) -> tuple[Proc, Proc, Proc]:
    p, d = pd_mock(module_procs, "p", "prefill"), pd_mock(module_procs, "d", "decode")
    return p, d, pd_router(module_procs, [("p", p)], [("d", d)])


@pytest.fixture
def pair(shared_pd: tuple[Proc, Proc, Proc]) -> Iterator[tuple[Proc, Proc, Proc]]:
    """A prefill engine, a decode engine and a router in front of both, shared by the module's
    tests: each starts from engines with fresh counts, and reads the router's counters as
    differences (the engines' starts are most of such a test's time)."""
    p, d, router = shared_pd
    for m in (p, d):
        control(m, reset_stats=True)
    yield p, d, router
    for m in (p, d):  # whatever a test changed
        control(m, ttft_ms=0, itl_ms=0, tokens=TOKENS, fail_status=0)
