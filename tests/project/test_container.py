"""What the container image relies on from the CLI: one-line errors (exit 2) for a start that
cannot work there, and the HEALTHCHECK probe finding the port the router listens on.
`make image-test` checks the same things in a real container."""

from __future__ import annotations

import http.server
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from router import cli
from router.tools import probe

BACKENDS = "backends:\n  - name: a\n    url: http://127.0.0.1:9\n    models: [m]\n"
K8S = "discovery:\n  - kind: kubernetes\n    namespace: models\n    service: vllm\n    port: http\n"


def serve_fails(config: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`sluicegate serve` stops before serving: exit 2 and exactly one line on stderr."""
    assert cli.main(["serve", "--config", str(config), "--port", "0", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_several_workers_without_a_writable_temp_dir_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(BACKENDS)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    # What a read-only root gives: no directory a temporary file can be made in.
    monkeypatch.setattr(tempfile, "tempdir", str(blocker / "tmp"))
    line = serve_fails(config, capsys, "--workers", "2")
    assert line.startswith("sluicegate: workers: 2 workers") and "--tmpfs /tmp" in line
    # One worker keeps its metrics in memory: no temporary directory needed, so no error here
    # (it would go on to serve; the check alone is called).
    cli.check_temp_dir(1)
    # An operator's directory that cannot be written is named.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(blocker / "metrics"))
    line = serve_fails(config, capsys)
    assert f"PROMETHEUS_MULTIPROC_DIR={blocker / 'metrics'}: not a writable directory" in line


def test_kubernetes_discovery_without_the_extra_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(K8S)
    # As if `sluicegate` were installed without [kubernetes]: the client cannot be imported.
    monkeypatch.setitem(sys.modules, "kubernetes_asyncio", None)
    line = serve_fails(config, capsys)
    assert f"config file {config}: discovery[0]: kind kubernetes needs" in line
    assert "pip install 'sluicegate[kubernetes]'" in line


@pytest.mark.parametrize(
    ("argv", "env", "url"),
    [
        ([], {}, "http://127.0.0.1:8080/healthz"),
        (["sluicegate", "serve"], {"SLUICEGATE_PORT": "18080"}, "http://127.0.0.1:18080/healthz"),
        (
            ["sluicegate", "serve", "--port", "9001"],
            {"SLUICEGATE_HOST": "0.0.0.0", "SLUICEGATE_PORT": "8080"},
            "http://127.0.0.1:9001/healthz",
        ),
        (
            ["/sbin/docker-init", "--", "sluicegate", "serve", "--port=9002", "--host", "::"],
            {},
            "http://[::1]:9002/healthz",
        ),
        (["sluicegate", "serve", "--host", "10.1.2.3"], {}, "http://10.1.2.3:8080/healthz"),
    ],
)
def test_probe_targets_the_address_the_router_was_started_on(
    argv: list[str], env: dict[str, str], url: str
) -> None:
    assert probe.target(argv, env) == url


@pytest.fixture
def healthz() -> Iterator[tuple[int, list[int]]]:
    """A loopback server answering /healthz with the status in the list (changeable)."""
    status = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status[0] if self.path == "/healthz" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], status
    finally:
        server.shutdown()
        server.server_close()


def test_probe_exit_code_follows_healthz(
    healthz: tuple[int, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, status = healthz
    monkeypatch.setattr(probe, "_main_argv", lambda: ["sluicegate", "serve", "--port", str(port)])
    assert probe.main() == 0
    status[0] = 503
    assert probe.main() == 1
    server_gone = ["sluicegate", "serve", "--port", "1"]  # nothing listens on port 1
    monkeypatch.setattr(probe, "_main_argv", lambda: server_gone)
    assert probe.main() == 1
