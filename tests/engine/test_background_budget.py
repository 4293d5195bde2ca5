"""Background cost stays flat with the number of backends (issue 31, case 7): scrapes and probes
run within a budget per second, taken in turn across backends, instead of one of each per
backend per interval (1,000 discovered endpoints took 0.9 core before; 5,000, seconds of p50).

The backends point at a closed loopback port, so every scrape and probe fails at once: what is
counted is how many were started, and for which backends."""

from __future__ import annotations

import asyncio

from health.monitor import HealthMonitor
from health.state import HealthBook, ProbeResult
from router.core.backend import Backend
from router.core.runner import Runner
from router.core.settings import BackendConfig, EngineMetricsConfig, HealthConfig
from router.engine.scraper import EngineScraper
from tests.support.clock import ManualClock, settle, until
from tests.support.harness import free_port


def fleet(n: int) -> list[Backend]:
    port = free_port()  # bound then closed: nothing listens
    return [
        Backend.from_config(
            BackendConfig(name=f"b{i}", url=f"http://127.0.0.1:{port}", models=["m"]),
            "kubernetes",
        )
        for i in range(n)
    ]


def test_scrapes_keep_to_the_budget_and_take_every_engine_in_turn() -> None:
    async def run() -> None:
        # 100 a second at a 0.1 s interval: 10 scrapes a tick for 50 engines.
        cfg = EngineMetricsConfig(interval=0.1, max_scrapes_per_second=100)
        scraper = EngineScraper(cfg)
        scraper.sync(fleet(50))

        async def settle() -> None:
            for _ in range(500):  # scrapes of a closed port end at once
                if not scraper.in_flight():
                    return
                await asyncio.sleep(0.01)

        try:
            for round_ in range(1, 6):
                scraper.tick()
                assert scraper.in_flight() == 1  # the tick's first slice of its 10
                await asyncio.sleep(cfg.interval)  # the other slices start across it
                await settle()
                done = sorted(scraper.errors().values())
                # In turn: after k ticks, 10k engines scraped once, none twice.
                assert done.count(1) == 10 * round_ and done.count(0) == 50 - 10 * round_
            scraper.tick()
            await asyncio.sleep(cfg.interval)
            await settle()
            assert sorted(scraper.errors().values()).count(2) == 10  # the next turn begins
        finally:
            await scraper.aclose()

    asyncio.run(run())


class CountingBook(HealthBook):
    def __init__(self, cfg: HealthConfig, clock: ManualClock) -> None:
        super().__init__(cfg, clock=clock.now)
        self.probes = 0

    def on_probe(self, name: str, result: ProbeResult) -> None:
        self.probes += 1
        super().on_probe(name, result)


def test_probes_keep_to_the_budget_however_many_backends() -> None:
    rate = 40.0
    seconds = 1.0

    async def run() -> int:
        # Every 0.05 s for 200 backends would be 4,000 probes a second.
        clock = ManualClock()
        runner = Runner(sleep=clock.sleep, clock=clock.now)
        runner.start()
        book = CountingBook(HealthConfig(interval=0.05, max_probes_per_second=rate), clock)
        backends = fleet(200)
        book.sync(backends)
        monitor = HealthMonitor(book, runner=runner, clock=clock.now)
        monitor.sync(backends)
        await monitor.start()
        try:
            for _ in range(100):  # a second of the monitor's clock, a hundredth at a time
                clock.advance(seconds / 100)
                await settle(5)
            # Those started finish (each fails at once); no more start while the clock stands.
            await until(lambda: not monitor._running, "the probes started have ended")
        finally:
            await monitor.aclose()
            await runner.stop()
        return book.probes

    probes = asyncio.run(run())
    # A burst of one second's worth, then `rate` a second (and a little slack for the clock).
    assert 0 < probes <= rate + rate * seconds + 5, probes


METRICS = (
    b"vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\n"
)


async def _metrics_server(answers: list[bool]) -> tuple[asyncio.Server, int]:
    """A /metrics endpoint on loopback: answers while `answers[0]` is True, else holds the
    request unanswered (an engine that stopped answering without closing)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                if not answers[0]:
                    await asyncio.sleep(3600)
                head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(METRICS)
                writer.write(head + METRICS)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_reading_turns_stale_stale_after_its_last_good_scrape() -> None:
    async def run() -> None:
        stale_after = 2.0
        now = [100.0]
        cfg = EngineMetricsConfig(interval=0.1, timeout=30, stale_after=stale_after)
        scraper = EngineScraper(cfg, monotonic=lambda: now[0])
        answering = {"good": [True], "hung": [True]}
        servers = {}
        backends = []
        for name, answers in answering.items():
            server, port = await _metrics_server(answers)
            servers[name] = server
            url = f"http://127.0.0.1:{port}"
            backends.append(
                Backend.from_config(BackendConfig(name=name, url=url, models=["m"], kind="vllm"))
            )
        scraper.sync(backends)

        async def scraped(count: int) -> None:
            """Until `count` scrapes ended and their readings are published."""
            for _ in range(1000):  # each scrape of a loopback server ends within milliseconds
                if scraper.scrapes >= count:
                    await asyncio.sleep(scraper._flush_delay() * 3)
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{scraper.scrapes} scrapes done, not {count}")

        def stale() -> dict[str, bool]:
            return {n: r.stale for n, r in scraper.readings.items()}

        try:
            scraper.tick()
            await scraped(2)
            assert stale() == {"good": False, "hung": False}
            answering["hung"][0] = False
            now[0] += stale_after / 2
            scraper.tick()  # hung's scrape now waits for an answer that does not come
            await scraped(3)
            assert scraper.in_flight() == 1 and stale() == {"good": False, "hung": False}
            now[0] += stale_after / 2 + 0.1  # hung's last good scrape is stale_after old
            scraper.tick()
            await scraped(4)
            assert stale() == {"good": False, "hung": True}
            # good's last good scrape is as old now: stale at the tick, fresh once scraped.
            now[0] += stale_after + 0.1
            scraper.tick()
            assert stale() == {"good": True, "hung": True}
            await scraped(5)
            assert stale() == {"good": False, "hung": True}
        finally:
            await scraper.aclose()
            for server in servers.values():
                server.close()

    asyncio.run(run())
