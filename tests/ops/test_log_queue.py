"""Logging never blocks the request path: a stalled stderr drops (and counts) lines instead of
freezing the router; exit flushes what is queued; ordinary header values are not redacted."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.core.settings import BackendConfig, Settings
from router.ops import logs
from tests.support.harness import ROOT, STARVED_S, Cluster, backend, free_port, stats, wait_http
from tests.support.wait import wait_for


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        yield
    finally:
        logs.stop()
        root.handlers[:], level = saved
        root.setLevel(level)


def test_a_stalled_stderr_drops_and_counts_never_blocks(
    root_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_fd, write_fd = os.pipe()  # nobody reads until the end: a stalled log consumer
    stalled = open(write_fd, "w", closefd=True)
    monkeypatch.setattr(sys, "stderr", stalled)
    logs.configure("info")
    counted: list[int] = []
    logs.count_drops(lambda: counted.append(1))
    log = logging.getLogger("sluicegate.test")
    n = logs.QUEUE_SIZE * 2

    def flood() -> None:
        for i in range(n):
            log.info("line", extra={"fields": {"i": i}})

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "a log call blocked on the stalled stderr"
    handler = logging.getLogger().handlers[0]
    dropped = getattr(handler, "dropped", 0)
    assert dropped > 0 and len(counted) == dropped

    # The consumer comes back: what was queued, and a line logged now, reach it on stop().
    chunks: list[bytes] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: os.read(read_fd, 65536), b"")), daemon=True
    )
    reader.start()
    wait_for(
        lambda: len(getattr(handler, "pending", ())) < logs.QUEUE_SIZE,
        "the writer drains",
        10,
        0.01,
    )
    log.info("the last line")
    logs.stop()
    stalled.close()
    reader.join(10)
    os.close(read_fd)
    lines = b"".join(chunks).decode().splitlines()
    assert json.loads(lines[-1])["msg"] == "the last line"
    assert len(lines) == n - dropped + 1


def test_a_line_queued_as_the_writer_stops_is_written_by_stop() -> None:
    import io

    out = io.StringIO()
    handler = logs._QueuedHandler(None, out)
    handler.setFormatter(logs.JsonFormatter(()))
    handler._stopping.set()
    handler._thread.join(5)
    # Another thread's record that saw the writer alive and landed after its last pass.
    record = logging.LogRecord("sluicegate.test", logging.WARNING, __file__, 1, "late", None, None)
    handler.pending.append(record)
    handler.stop()
    assert not handler.pending
    assert json.loads(out.getvalue().splitlines()[-1])["msg"] == "late"


def test_ordinary_header_values_are_not_secrets_but_secret_ones_are() -> None:
    settings = Settings(
        backends=[
            BackendConfig(
                name="a",
                url="http://a:1",
                models=["m"],
                headers={
                    "x-ms-client-request-source": "sluicegate",
                    "x-team": "inference-platform",
                    "x-api-key": "shortkey",
                    "x-tenant": "t0kenABCDEF1234567890",
                },
            )
        ]
    )
    fmt = logs.JsonFormatter(logs.secrets_of(settings))
    record = logging.LogRecord("sluicegate.request", logging.INFO, __file__, 1, "", None, None)
    record.msg = "sent x-api-key shortkey and t0kenABCDEF1234567890 for inference-platform"
    line = json.loads(fmt.format(record))
    assert line["logger"] == "sluicegate.request"
    assert "inference-platform" in line["msg"]
    assert "shortkey" not in line["msg"] and "t0kenABCDEF1234567890" not in line["msg"]


def test_router_with_a_stalled_stderr_keeps_serving(procs: Cluster) -> None:
    mock = procs.mock("a", tokens=2)
    port = free_port()
    config = procs.write_config(
        {"backends": [backend("a", mock, headers={"x-ms-client-request-source": "sluicegate"})]}
    )
    # A consumer that reads a little and then stops reading, as a stalled log driver does.
    consumer = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.stdin.buffer.read(4096); time.sleep(60)"],
        stdin=subprocess.PIPE,
    )
    router: subprocess.Popen[bytes] | None = None
    try:
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router.cli",
                "serve",
                "--config",
                str(config),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=consumer.stdin,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env={**os.environ, "SLUICEGATE_LOG_LEVEL": "debug"},
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", proc=router)
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(base_url=url, timeout=STARVED_S) as client:
            for _ in range(500):
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
            assert client.get("/healthz").status_code == 200
            metrics = client.get("/metrics").text
        dropped = [
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("sluicegate_log_dropped_total ")
        ]
        assert dropped, "sluicegate_log_dropped_total not exported"
        # It still stops when asked, its last lines stuck behind the stalled pipe.
        router.send_signal(signal.SIGTERM)
        assert router.wait(STARVED_S) == 0
    finally:
        for p in (router, consumer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
        if consumer.stdin is not None:
            consumer.stdin.close()
        Path(config).unlink(missing_ok=True)


def test_lines_logged_while_draining_on_sigterm_are_written(procs: Cluster) -> None:
    mock = procs.mock("slow", tokens=8, itl_ms=100)
    # Two workers: each ends by uvicorn's re-raised SIGTERM, which skips atexit handlers.
    router = procs.router({"backends": [backend("a", mock)]}, workers=2)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    done: list[int] = []

    def stream() -> None:
        with httpx.stream(
            "POST", router.url + "/v1/chat/completions", json=body, timeout=STARVED_S
        ) as r:
            done.append(sum(len(c) for c in r.iter_bytes()))

    t = threading.Thread(target=stream)
    t.start()
    wait_for(lambda: stats(mock)["running"] == 1, "the stream under way", STARVED_S)
    router.signal(signal.SIGTERM)
    t.join(STARVED_S)
    assert done and done[0] > 0
    assert router.popen.wait(STARVED_S) == 0
    lines = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
    # The request that finished during the drain, and the server's last words, made it out.
    assert any(line["msg"] == "request" and line.get("status") == 200 for line in lines)
    finished = [line["pid"] for line in lines if line["msg"].startswith("Finished server process")]
    assert len(set(finished)) == 2, finished
