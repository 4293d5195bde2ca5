"""`sluicegate serve | demo | mock-upstream`: the console entry point."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn

from router.settings import ConfigError, Settings, load_settings


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: fail /readyz, answer new requests 503, let streams in flight
    finish (up to drain_grace), then stop. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, drain_grace: float) -> None:
        super().__init__(config)
        self._drain_grace = drain_grace
        self._draining = False

    def _lifecycle(self) -> Any:
        app: Any = getattr(self.config, "loaded_app", None)
        for _ in range(10):
            state = getattr(app, "state", None)
            if state is not None and hasattr(state, "lifecycle"):
                return state.lifecycle
            app = getattr(app, "app", None)
        return None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        lifecycle = self._lifecycle()
        if self._draining or lifecycle is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        lifecycle.draining = True
        # A signal handler runs between bytecodes of whatever the loop was doing: schedule.
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(lifecycle)))

    async def _drain(self, lifecycle: Any) -> None:
        await lifecycle.wait_idle(self._drain_grace)
        self.should_exit = True


def _app_factory() -> Any:
    from router.app import create_app
    from router.logs import configure

    settings = load_settings()
    configure(settings.log_level)
    return create_app(settings)


def serve(settings: Settings) -> None:
    from router.logs import configure

    configure(settings.log_level)
    # Workers re-read settings from the environment, so pass what the CLI decided through it.
    if settings.config:
        os.environ["SLUICEGATE_CONFIG"] = settings.config
    config = uvicorn.Config(
        "router.cli:_app_factory",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        server_header=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, int(settings.drain_grace) + 1),
        timeout_keep_alive=30,
    )
    server = DrainingServer(config, settings.drain_grace)
    if settings.workers > 1:
        from uvicorn.supervisors import Multiprocess

        sock = config.bind_socket()
        if "target" in inspect.signature(Multiprocess).parameters:
            Multiprocess(config, target=server.run, sockets=[sock]).run()  # type: ignore[call-arg]
        else:
            # Newer uvicorn runs its own Server in each worker (no DrainingServer there).
            Multiprocess(config, sockets=[sock]).run()
    else:
        server.run()


def _demo_config(ports: Sequence[int]) -> str:
    lines = ["backends:"]
    for i, port in enumerate(ports):
        lines += [
            f"  - name: demo-{'ab'[i]}",
            f"    url: http://127.0.0.1:{port}",
            "    models:",
            "      demo-model: mock-model",
        ]
    lines += ["health: {interval: 2}"]
    return "\n".join(lines) + "\n"


def demo(host: str, port: int) -> int:
    """Two mock upstreams and the router, in the foreground, until Ctrl-C."""
    upstream_ports = (port + 101, port + 102)
    procs = []
    try:
        for i, up in enumerate(upstream_ports):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "router.cli",
                        "mock-upstream",
                        "--port",
                        str(up),
                        "--name",
                        f"demo-{'ab'[i]}",
                        "--ttft-ms",
                        "50",
                        "--itl-ms",
                        "20",
                        "--tokens",
                        "64",
                    ]
                )
            )
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(_demo_config(upstream_ports))
        print(
            f"sluicegate demo: router on http://{host}:{port}/v1 (model `demo-model`), "
            f"mock upstreams on {upstream_ports}; Ctrl-C stops",
            flush=True,
        )
        time.sleep(0.5)
        serve(load_settings(f.name, host=host, port=port))
        return 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluicegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_serve = sub.add_parser("serve", help="run the router")
    p_serve.add_argument("--host")
    p_serve.add_argument("--port", type=int)
    p_serve.add_argument("--workers", type=int)
    p_serve.add_argument("--config", help="YAML file (default: $SLUICEGATE_CONFIG)")

    p_demo = sub.add_parser("demo", help="router + two mock upstreams on 127.0.0.1, no Redis")
    p_demo.add_argument("--host", default="127.0.0.1")
    p_demo.add_argument("--port", type=int, default=8080)

    p_mock = sub.add_parser("mock-upstream", help="a vLLM-compatible mock backend")
    p_mock.add_argument("--host", default="127.0.0.1")
    p_mock.add_argument("--port", type=int, default=8000)
    p_mock.add_argument("--name", default="mock")
    p_mock.add_argument("--ttft-ms", type=float, default=0.0)
    p_mock.add_argument("--itl-ms", type=float, default=0.0)
    p_mock.add_argument("--tokens", type=int, default=16)

    args = parser.parse_args(argv)
    if args.command == "mock-upstream":
        from router.mock_upstream import run

        run(args.host, args.port, args.name, args.ttft_ms, args.itl_ms, args.tokens)
        return 0
    try:
        if args.command == "demo":
            return demo(args.host, args.port)
        settings = load_settings(args.config, host=args.host, port=args.port, workers=args.workers)
    except ConfigError as exc:
        print(f"sluicegate: {exc}", file=sys.stderr)
        return 2
    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
