"""`sluicegate serve | status | demo | mock-upstream | engines`: the console entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from router.core.settings import Settings


def drain_on_signal(lifecycle: Any, grace: float) -> None:
    """On the first SIGTERM/SIGINT: fail /readyz, answer new requests 503, let streams in flight
    finish (up to `grace` seconds), then hand the signal to the server. A second one stops at once.

    uvicorn installs its handlers before it loads the app, in every worker, so wrapping them here
    works the same with one worker or several.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # not under a server (e.g. the app built directly in a test)
    tasks: set[asyncio.Task[None]] = set()

    async def finish(original: Any, signum: int) -> None:
        await lifecycle.wait_idle(grace)
        original(signum, None)

    for sig in (signal.SIGTERM, signal.SIGINT):
        original = signal.getsignal(sig)
        if not callable(original):
            continue

        def handler(signum: int, frame: FrameType | None, original: Any = original) -> None:
            if lifecycle.draining:
                original(signum, frame)
                return
            lifecycle.draining = True

            def start() -> None:
                task = loop.create_task(finish(original, signum))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

            # A signal handler runs between bytecodes of whatever the loop was doing: schedule.
            loop.call_soon_threadsafe(start)

        signal.signal(sig, handler)


def _app_factory() -> Any:
    from router.app import create_app
    from router.core.settings import load_settings
    from router.ops.logs import configure, secrets_of

    settings = load_settings()
    configure(settings.log_level, secrets_of(settings))
    app = create_app(settings)
    drain_on_signal(app.lifecycle, settings.drain_grace)
    return app


_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def _metrics_dir(workers: int) -> Iterator[None]:
    """Where the workers' metric files live: the operator's directory (e.g. an emptyDir, which
    outlives a container restart) emptied of a previous run's files, or with several workers a
    temporary one removed at exit. Set before any worker imports prometheus_client."""
    given = os.environ.get(_MULTIPROC_ENV)
    if given:
        os.makedirs(given, exist_ok=True)
        for stale in glob.glob(os.path.join(given, "*.db")):
            os.remove(stale)
        yield
        return
    if workers < 2:
        yield
        return
    path = tempfile.mkdtemp(prefix="sluicegate-metrics-")
    os.environ[_MULTIPROC_ENV] = path
    try:
        yield
    finally:
        os.environ.pop(_MULTIPROC_ENV, None)
        shutil.rmtree(path, ignore_errors=True)


def check_temp_dir(workers: int) -> None:
    """Several workers share their metrics through files: in PROMETHEUS_MULTIPROC_DIR when set,
    else in a new temporary directory. On a read-only root filesystem there is none unless one
    is mounted: a `ConfigError` saying so, not a traceback from the workers."""
    from router.core.settings import ConfigError

    given = os.environ.get(_MULTIPROC_ENV)
    if given:
        try:
            os.makedirs(given, exist_ok=True)
            tempfile.TemporaryFile(dir=given).close()
        except OSError as exc:
            raise ConfigError(
                f"{_MULTIPROC_ENV}={given}: not a writable directory ({exc.strerror or exc})"
            ) from None
        return
    if workers < 2:
        return
    try:
        tempfile.TemporaryFile().close()
    except OSError:
        raise ConfigError(
            f"workers: {workers} workers keep their metrics in a temporary directory, and none "
            "is writable (read-only root filesystem?): mount one (docker run --tmpfs /tmp) "
            f"or set {_MULTIPROC_ENV} to a writable directory"
        ) from None


def serve(settings: Settings) -> None:
    from router.ops.logs import configure, secrets_of
    from router.web.edge import protocol, raise_fd_limit

    configure(settings.log_level, secrets_of(settings))
    # Per worker: its client connections, every backend pool full, and a margin for Redis,
    # probes and the rest. Workers inherit the raised limit.
    pools = settings.limits.max_connections * len(settings.backends)
    raise_fd_limit(settings.server.max_connections + pools + 64)
    # Workers re-read settings from the environment, so pass what the CLI decided through it.
    if settings.config:
        os.environ["SLUICEGATE_CONFIG"] = settings.config
    # One hop-marker id for this invocation, the same in every worker
    # (router/request/admit/hops.py).
    if not settings.deployment_id:
        from router.request.admit.hops import new_deployment_id

        os.environ["SLUICEGATE_DEPLOYMENT_ID"] = new_deployment_id()
    # uvicorn re-raises the SIGTERM it handled once it has stopped; after a completed drain that
    # is a clean exit, not a death by signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with _metrics_dir(settings.workers):
        uvicorn.run(
            "router.cli:_app_factory",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            loop="uvloop",
            http=protocol(
                settings.server.header_timeout,
                settings.server.max_connections,
                settings.server.body_timeout,
            ),
            lifespan="on",
            access_log=False,
            server_header=False,
            log_config=None,  # ours (router.ops.logs): JSON lines with secrets redacted
            log_level=settings.log_level,
            timeout_graceful_shutdown=max(1, int(settings.drain_grace) + 1),
            # Annotated int by uvicorn, used as call_later()'s float seconds.
            timeout_keep_alive=settings.server.keepalive_timeout,  # type: ignore[arg-type]
        )


def _demo_config(ports: Sequence[int]) -> str:
    lines = ["backends:"]
    for i, port in enumerate(ports):
        lines += [
            f"  - name: demo-{'ab'[i]}",
            f"    url: http://127.0.0.1:{port}",
            "    models:",
            "      demo-model: mock-model",
        ]
    lines += ["health: {interval: 2}", "console: {enabled: true}"]
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
            f"the console on http://{host}:{port}/console, mock upstreams on {upstream_ports}; "
            "Ctrl-C stops",
            flush=True,
        )
        time.sleep(0.5)
        from router.core.settings import load_settings

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


def engines(args: argparse.Namespace) -> int:
    """Real vLLM engines on loopback (installed and the model written first), until Ctrl-C."""
    from pathlib import Path

    from router.tools.enginefleet.fleet import EngineOptions, Fleet, ready_line, sample_config
    from router.tools.enginefleet.install import engine_home, ensure_venv, nixl_dir
    from router.tools.enginefleet.model import write_model

    roles = ["prefill", "decode"] if args.pd else args.roles
    if roles and len(roles) != args.count:
        print(f"--roles: {len(roles)} roles for --count {args.count}", file=sys.stderr)
        return 2
    lens: list[int] = args.max_model_len
    if len(lens) not in (1, args.count):
        print(f"--max-model-len: {len(lens)} values for --count {args.count}", file=sys.stderr)
        return 2
    home = Path(args.home) if args.home else engine_home()
    python = ensure_venv(home)
    model = write_model(home / "models")
    if args.install_only:
        print(f"vLLM venv ready: {python}; NIXL: {nixl_dir(home)}; model: {model}")
        return 0
    options = EngineOptions(
        model_name=args.model_name,
        kv_blocks=args.kv_blocks,
        max_model_len=lens[0],
        nixl=nixl_dir(home) if roles else None,  # roles are for prefill/decode handoffs
    )
    each = lens if len(lens) > 1 else None
    fleet = Fleet(python, model, args.count, options, roles=roles or None, max_model_lens=each)
    # SIGTERM unwinds like Ctrl-C, through the `finally` that stops every engine. SIGINT is set
    # again because a shell starting us in the background hands it over ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        print(f"starting {args.count} vLLM engine(s), logs in {fleet.run_dir}", flush=True)
        fleet.start()
        config = Path(args.write_config) if args.write_config else home / "engines.yaml"
        config.write_text(sample_config(fleet))
        print(ready_line(fleet.engines), flush=True)
        print(f"model `{options.model_name}`; a sluicegate config for them, in {config}:")
        print(config.read_text(), flush=True)
        print(f"run the router in front of them: sluicegate serve --config {config}")
        print("Ctrl-C stops the engines", flush=True)
        while all(e.alive() for e in fleet.engines):
            time.sleep(1.0)
        dead = [e for e in fleet.engines if not e.alive()]
        for e in dead:
            print(f"engine {e.index} exited:\n{e.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        fleet.stop()


def check_tokenizers(settings: Settings) -> None:
    """Each `affinity.tokenizers` directory loads, before any worker starts (ConfigError)."""
    from router.core.settings import ConfigError
    from router.request.placement.tokens import RouterTokenizer, TokenizerError

    for model, tc in settings.affinity.tokenizers.items():
        if tc.via == "router" and tc.path:
            try:
                RouterTokenizer(tc.path)
            except TokenizerError as exc:
                raise ConfigError(f"affinity.tokenizers.{model}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluicegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_serve = sub.add_parser("serve", help="run the router")
    p_serve.add_argument("--host")
    p_serve.add_argument("--port", type=int)
    p_serve.add_argument("--workers", type=int)
    p_serve.add_argument("--config", help="YAML file (default: $SLUICEGATE_CONFIG)")

    p_epp = sub.add_parser(
        "epp", help="the endpoint picker behind a gateway's ext_proc filter (Envoy, GIE)"
    )
    p_epp.add_argument("--config", help="YAML file (default: $SLUICEGATE_CONFIG)")
    p_epp.add_argument("--host")
    p_epp.add_argument("--port", type=int, default=9002, help="gRPC: ext_proc and health")
    p_epp.add_argument("--metrics-port", type=int, default=9090, help="HTTP: metrics, admin")

    p_status = sub.add_parser("status", help="a table of the backends of a running router")
    p_status.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8080")
    p_status.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p_status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p_status.add_argument("--count", type=int, help="with --watch: stop after this many refreshes")

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
    p_mock.add_argument(
        "--served-model-name",
        nargs="+",
        help="answer only these models (vLLM's 404 for others); default: any name",
    )
    p_mock.add_argument("--max-model-len", type=int, default=131072, help="context length")
    tls = p_mock.add_argument_group("TLS: serve https (a backend behind a private CA)")
    tls.add_argument("--ssl-certfile", help="PEM server certificate")
    tls.add_argument("--ssl-keyfile", help="PEM server key")
    tls.add_argument("--ssl-ca-certs", help="PEM CA: client certificates it signed are required")
    eng = p_mock.add_argument_group(
        "engine model (router/tools/mock/engine.py): behave like a vLLM"
    )
    eng.add_argument("--engine", action="store_true", help="simulate a vLLM scheduler")
    eng.add_argument("--max-num-seqs", type=int, default=32)
    eng.add_argument("--kv-tokens", type=int, default=65536, help="KV capacity in tokens")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--prefill-ms-per-1k", type=float, default=20.0)
    eng.add_argument("--decode-ms", type=float, default=10.0, help="step time, empty batch")
    eng.add_argument("--decode-ms-per-seq", type=float, default=0.5, help="added per sequence")
    eng.add_argument("--background", type=int, default=0, help="hidden sequences kept running")
    eng.add_argument("--background-prompt", type=int, default=1000)
    eng.add_argument("--background-tokens", type=int, default=200)
    eng.add_argument("--old-kv-metric", action="store_true", help="vllm:gpu_cache_usage_perc")
    eng.add_argument("--sglang-metrics", action="store_true", help="export SGLang's names")
    eng.add_argument(
        "--no-prefix-caching", action="store_true", help="turn off automatic prefix caching"
    )
    eng.add_argument("--kv-events", help="publish KV-cache events here (ipc://... or tcp://*:P)")
    eng.add_argument(
        "--kv-events-replay", help="serve vLLM's replay socket here (ipc://... or tcp://*:P)"
    )
    eng.add_argument(
        "--kv-events-encoding",
        choices=("map", "array"),
        default="map",
        help="vLLM's event encoding: map (0.24 on) or array (before)",
    )

    eng.add_argument("--max-loras", type=int, default=0, help="LoRA slots (vLLM --enable-lora)")
    eng.add_argument(
        "--lora-modules", nargs="+", default=[], help="adapters at start: NAME=PATH (vLLM's form)"
    )
    eng.add_argument("--lora-load-ms", type=float, default=0.0, help="a run-time load's time")
    eng.add_argument("--lora-slot-ms", type=float, default=0.0, help="moving one into a slot")
    pd = p_mock.add_argument_group("prefill/decode handoff (router/tools/mock/handoff.py)")
    pd.add_argument("--kv-role", choices=("prefill", "decode", "both"), help="turns it on")
    pd.add_argument("--kv-connector", choices=("nixl", "sglang"), default="nixl")
    pd.add_argument("--kv-engine-id", default="", help="NIXL engine id (default: from the name)")
    pd.add_argument(
        "--kv-fail-delay-ms", type=float, default=5000.0, help="a failed pull's 500 this late"
    )
    pd.add_argument("--kv-lease-ms", type=float, default=30000.0, help="held blocks expire")

    p_eng = sub.add_parser("engines", help="real vLLM engines (CPU build, tiny local model)")
    p_eng.add_argument("--count", type=int, default=2, help="engines, one per core")
    p_eng.add_argument(
        "--roles",
        nargs="+",
        choices=("prefill", "decode", "both"),
        help="one per engine; runs vLLM's NixlConnector (KV handed from prefill to decode)",
    )
    p_eng.add_argument("--pd", action="store_true", help="a prefill and a decode engine (--roles)")
    p_eng.add_argument("--kv-blocks", type=int, default=64, help="KV blocks (128 tokens) each")
    p_eng.add_argument(
        "--max-model-len",
        type=int,
        nargs="+",
        default=[2048],
        help="the context length: one for every engine, or one per engine",
    )
    p_eng.add_argument("--model-name", default="tiny-llama", help="the served model name")
    p_eng.add_argument("--home", help="venv and model (default $SLUICEGATE_ENGINE_HOME)")
    p_eng.add_argument("--write-config", help="where to write the sluicegate config")
    p_eng.add_argument("--install-only", action="store_true", help="install and write; no start")

    args = parser.parse_args(argv)
    if args.command == "engines":
        if args.pd:
            args.count = 2
        return engines(args)
    if args.command == "status":
        from router.tools.status import run as status

        try:
            return status(args.url, args.watch, max(0.1, args.interval), args.count)
        except KeyboardInterrupt:
            return 0
    if args.command == "mock-upstream":
        from router.tools.mock.handoff import HandoffConfig
        from router.tools.mock.upstream import run

        engine = None
        if args.engine:
            from router.tools.mock.engine import EngineConfig

            engine = EngineConfig(
                max_num_seqs=args.max_num_seqs,
                kv_tokens=args.kv_tokens,
                block_size=args.block_size,
                prefill_ms_per_1k=args.prefill_ms_per_1k,
                decode_ms=args.decode_ms,
                decode_ms_per_seq=args.decode_ms_per_seq,
                background=args.background,
                background_prompt=args.background_prompt,
                background_tokens=args.background_tokens,
                kv_metric="vllm:gpu_cache_usage_perc"
                if args.old_kv_metric
                else "vllm:kv_cache_usage_perc",
                flavor="sglang" if args.sglang_metrics else "vllm",
                prefix_caching=not args.no_prefix_caching,
                kv_events=args.kv_events,
                kv_events_encoding=args.kv_events_encoding,
                kv_events_replay=args.kv_events_replay,
                max_loras=args.max_loras,
                lora_modules=dict(m.split("=", 1) for m in args.lora_modules),
                lora_load_ms=args.lora_load_ms,
                lora_slot_ms=args.lora_slot_ms,
            )
        run(
            args.host,
            args.port,
            args.name,
            args.ttft_ms,
            args.itl_ms,
            args.tokens,
            engine=engine,
            served_model_names=args.served_model_name,
            max_model_len=args.max_model_len,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            ssl_ca_certs=args.ssl_ca_certs,
            handoff=HandoffConfig(
                role=args.kv_role,
                connector=args.kv_connector,
                engine_id=args.kv_engine_id,
                host=args.host,
                fail_delay_ms=args.kv_fail_delay_ms,
                lease_ms=args.kv_lease_ms,
            )
            if args.kv_role
            else None,
        )
        return 0
    # Imported here, not at the top: a mock upstream (tests start hundreds) needs none of them.
    from router.core.settings import ConfigError, load_settings
    from router.discovery.runner import check_discovery
    from router.registry.fleet import check_balancers

    try:
        if args.command == "demo":
            return demo(args.host, args.port)
        if args.command == "epp":
            settings = load_settings(args.config, host=args.host, port=args.metrics_port)
        else:
            settings = load_settings(
                args.config, host=args.host, port=args.port, workers=args.workers
            )
        check_balancers(settings)
        check_tokenizers(settings)
        check_discovery(settings)
        check_temp_dir(settings.workers)
    except ConfigError as exc:
        print(f"sluicegate: {exc}", file=sys.stderr)
        return 2
    if args.command == "epp":
        return epp(settings, args.port)
    serve(settings)
    return 0


def epp(settings: Settings, grpc_port: int) -> int:
    """`sluicegate epp`: one process, the gRPC port and the HTTP port on one event loop."""
    from router.ops.logs import configure, secrets_of
    from router.picker.server import run

    configure(settings.log_level, secrets_of(settings))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(run(settings, settings.host, grpc_port, settings.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
