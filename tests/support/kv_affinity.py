"""An `Affinity` that tokenizes through the engines (`via: engine`), over backends whose KV-event
feeds are marked live without a socket: for tests of what the router asks the engines."""

from __future__ import annotations

from router.core.backend import Backend
from router.core.settings import AffinityConfig, BackendConfig, TokenizerConfig
from router.engine.kv_events import Feed, KvEvents
from router.request.placement.affinity import Affinity


def engine_backend(name: str, url: str) -> Backend:
    """A backend serving model "m" as the mock's "mock-model", with KV events configured."""
    cfg = BackendConfig(name=name, url=url, models={"m": "mock-model"}, kv_events={})  # type: ignore[arg-type]
    return Backend.from_config(cfg)


def engine_affinity(backends: list[Backend], live: list[str]) -> Affinity:
    """`via: engine` for model "m" over `backends`, the events of those named in `live` live."""
    kv = KvEvents()
    kv.sync(backends)
    for name in live:
        feed = Feed(name, f"ipc:///nonexistent/{name}.sock", False, b"", None)
        feed.state = "live"
        kv._engines[name].feeds = [feed]
    return Affinity(AffinityConfig(tokenizers={"m": TokenizerConfig(via="engine")}), kv=kv)
