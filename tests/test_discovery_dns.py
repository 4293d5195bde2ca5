"""DNS discovery end to end: a real router re-resolves a name on a real DNS server (dnslib, UDP on
a loopback port) whose answers change, and routes to real mock engines on the addresses it
answers (127.0.0.2, 127.0.0.3, ... share one port, as pods behind a headless Service do)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from tests.harness import Cluster, Proc, free_port, stats


class Answers(BaseResolver):  # type: ignore[misc]
    """Answers A queries for the names in `records`; NXDOMAIN for others, SERVFAIL when
    `failing`. AAAA gets an empty answer."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.failing = False
        self.queries = 0
        self.lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".")
        with self.lock:
            self.queries += 1
            if self.failing:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            if qname not in self.records:
                reply.header.rcode = RCODE.NXDOMAIN
                return reply
            if request.q.qtype == QTYPE.A:
                for ip in self.records[qname]:
                    reply.add_answer(RR(qname, QTYPE.A, rdata=A(ip), ttl=1))
        return reply


@pytest.fixture(scope="module")
def dns() -> Iterator[tuple[Answers, int]]:
    answers = Answers()
    port = free_port()
    server = DNSServer(
        answers, address="127.0.0.1", port=port, logger=DNSLogger(log="-request,-reply,-truncated")
    )
    server.start_thread()
    try:
        yield answers, port
    finally:
        server.stop()


def backends(router: Proc) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.url + "/admin/backends", timeout=5)
    r.raise_for_status()
    return {b["url"]: b for b in r.json()}


def wait_for(check: Callable[[], bool], deadline: float, what: str) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {deadline}s: {what}")


def metric(router: Proc, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(router.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rpartition(" ")[2])
    return total


def test_backends_follow_changing_answers_and_a_bad_answer_keeps_the_last_set(
    procs: Cluster, dns: tuple[Answers, int]
) -> None:
    answers, dns_port = dns
    port = free_port()
    m2 = procs.mock("m2", port=port, host="127.0.0.2", tokens=4)
    m3 = procs.mock("m3", port=port, host="127.0.0.3", tokens=4)
    answers.records = {"vllm.test": ["127.0.0.2"]}
    ns = f"127.0.0.1:{dns_port}"
    common = {"kind": "dns", "port": port, "interval": 0.3, "timeout": 0.5, "nameserver": ns}
    router = procs.router(
        {
            "discovery": [
                # models: auto; 127.0.0.4 answers later but no engine listens there.
                {**common, "name": "vllm.test", "models": "auto"},
                {**common, "name": "nowhere.test", "models": ["other"]},  # never resolves
            ],
            "health": {"interval": 1, "timeout": 1},
        }
    )
    wait_for(lambda: set(backends(router)) == {m2.url}, 10, "the first answer's backend")
    b = backends(router)[m2.url]
    assert b["source"] == "dns" and b["models"] == {"mock-model": "mock-model"}

    # A new address joins and takes traffic.
    answers.records = {"vllm.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4"]}
    wait_for(lambda: m3.url in backends(router), 3, "the new address joins")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    for _ in range(8):
        client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "x"}]
        )
    assert stats(m3)["requests"] > 0 and stats(m2)["requests"] > 0
    # 127.0.0.4: /v1/models fails there, so it is left out, warned about and counted.
    wait_for(
        lambda: metric(router, "sluicegate_discovery_events_total", event="models_failed") > 0,
        3,
        "models: auto failure counted",
    )
    assert f"http://127.0.0.4:{port}" not in backends(router)
    assert "models: auto" in router.log()

    # The server fails: the last set stays, the source is stale.
    answers.failing = True
    wait_for(
        lambda: httpx.get(router.url + "/readyz").json()["discovery"][0]["stale"],
        3,
        "stale after a failed lookup",
    )
    time.sleep(0.7)  # a few more failed rounds
    assert set(backends(router)) == {m2.url, m3.url}
    ready = httpx.get(router.url + "/readyz")
    assert ready.status_code == 200
    nowhere = ready.json()["discovery"][1]
    assert nowhere["stale"] is True and nowhere["backends"] == 0
    assert metric(router, "sluicegate_discovery_events_total", event="lookup_failed") >= 2

    # An address vanishes: it drains (nothing in flight here) and goes.
    answers.failing = False
    answers.records = {"vllm.test": ["127.0.0.3"]}
    wait_for(lambda: set(backends(router)) == {m3.url}, 3, "the vanished address removed")
    assert metric(router, "sluicegate_discovery_backends", source="dns") == 1
    assert not httpx.get(router.url + "/readyz").json()["discovery"][0]["stale"]
