"""One fleet for the picker's replay and Envoy tests (package scope: when xdist gives both files
to one worker, they share it): engines `a` and `b` serve `m`; `c` serves `tight`, one request
at a time (`max_inflight: 1`), slowly, behind an admission queue of one; the picker
(`balancer: cache_aware`) and the example Envoy in front of it. The only addition to the
example: a header_to_metadata filter, which stands for the gateway logic that writes the subset
hint (`envoy.lb.subset_hint`) in a real deployment."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.harness import Cluster, backend
from tests.support.picker import envoy_in_front, start_picker

SUBSET_HEADER = "x-test-subset"
SUBSET_FILTER = {
    "name": "envoy.filters.http.header_to_metadata",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [
            {
                "header": SUBSET_HEADER,
                "on_header_present": {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "key": "x-gateway-destination-endpoint-subset",
                    "type": "STRING",
                },
                "remove": True,
            }
        ],
    },
}


@pytest.fixture(scope="package")
def fleet() -> Iterator[dict[str, Any]]:
    procs = Cluster()
    try:
        a, b = procs.mock("a"), procs.mock("b")
        c = procs.mock("c", itl_ms=100, tokens=40)
        picker = start_picker(
            procs,
            {
                "backends": [
                    backend("a", a, {"m": "m"}),
                    backend("b", b, {"m": "m"}),
                    backend("c", c, {"tight": "tight"}, max_inflight=1),
                ],
                "balancer": "cache_aware",
                "expose_backend_header": True,
                "admission": {"max_queue": 1, "max_wait": 10},
                "health": {"interval": 60},
            },
        )
        envoy = envoy_in_front(procs, picker, [SUBSET_FILTER])
        yield {"a": a, "b": b, "c": c, "picker": picker, "envoy": envoy}
    finally:
        procs.close()
