"""`balancer: latency` with admission, end to end: a sheddable request's TTFT SLO counts the
admission queue's wait. One mock engine behind a router whose backend takes one request at a
time (`max_inflight: 1`) and which has no model yet (`min_samples` out of reach: only the queue
can be judged). A sheddable request that would queue behind others for longer than its SLO is
refused 429 `slo_unattainable` at once; one that queued and waited past its SLO is refused when
its turn comes instead of being sent; standard requests with the same SLO are served.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from tests.support.harness import STARVED_S, Cluster, Proc, backend, in_flight, streamed_chat
from tests.support.wait import wait_for

ENGINE = ["--engine", "--max-num-seqs", "8", "--decode-ms", "20"]
# Any queue wait exceeds this: what is judged is the wait, not how long it is on this machine.
SLO = {"x-slo-ttft-ms": "0.001"}
SHEDDABLE = {**SLO, "x-sluicegate-priority": "sheddable"}
_sent = itertools.count()


@pytest.fixture(scope="module")
def router(module_procs: Cluster) -> Proc:
    engine = module_procs.mock("one", tokens=2000, engine_args=ENGINE)
    return module_procs.router(
        {
            "backends": [{**backend("one", engine), "max_inflight": 1}],
            "balancer": "latency",
            "latency": {"min_samples": 100_000},
            "admission": {"max_wait": 10},
            "health": {"interval": 60},
        },
        env={"SLUICEGATE_LOG_LEVEL": "warning"},
    )


def metric(router: Proc, name: str, labels: str = "") -> float:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and labels in line
    )


def depth(router: Proc) -> float:
    return metric(router, "sluicegate_queue_depth")


@contextmanager
def holding(router: Proc) -> Iterator[None]:
    """The backend's one slot held by a long stream until the block ends (the client leaves)."""
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 2000,
        "messages": [{"role": "user", "content": f"{next(_sent)} hold"}],
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # held: a dropped iterator closes the stream
        next(chunks)
        yield


def chat(router: Proc, headers: dict[str, str]) -> httpx.Response:
    return streamed_chat(router, f"{next(_sent)} hi", 2, headers)


def queued(
    pool: ThreadPoolExecutor, router: Proc, headers: dict[str, str]
) -> Future[httpx.Response]:
    """`chat` sent aside; returns once it waits in the admission queue."""
    before = depth(router)
    got = pool.submit(chat, router, headers)
    wait_for(lambda: depth(router) == before + 1, "the request queued")
    return got


def test_a_sheddable_request_is_refused_for_the_queue_it_would_wait_in(router: Proc) -> None:
    def shed() -> float:
        return metric(router, "sluicegate_shed_total", 'reason="slo_unattainable"')

    before = shed()
    with ThreadPoolExecutor(4) as pool:
        # Nothing queues ahead of it, so it queues; when its turn comes it has waited past its
        # SLO: refused then rather than sent late.
        with holding(router):
            late = queued(pool, router, SHEDDABLE)
        answer = late.result(timeout=20)
        assert answer.status_code == 429, answer.text
        assert answer.json()["error"]["code"] == "slo_unattainable"
        wait_for(lambda: depth(router) == 0, "the queue emptied")
        with holding(router):
            standard = queued(pool, router, SLO)
            # One waits ahead, and the queue let one through a while ago: the predicted wait
            # is past the SLO, so it is refused at once (not queued until max_wait).
            now = chat(router, SHEDDABLE)
            assert now.status_code == 429 and int(now.headers["retry-after"]) >= 1
            assert now.json()["error"]["code"] == "slo_unattainable"
            assert depth(router) == 1
            # Standard traffic is never shed for its SLO: it queues and is served.
            also = queued(pool, router, SLO)
        assert standard.result(timeout=20).status_code == 200
        assert also.result(timeout=20).status_code == 200
    assert shed() == before + 2
    # Nothing queued, the slot free, no model to judge the engine by: the same request is
    # served (its slot is given back just after its answer's last byte: waited for).
    wait_for(lambda: depth(router) == 0 and in_flight(router) == 0, "the slot freed")
    assert chat(router, SHEDDABLE).status_code == 200
