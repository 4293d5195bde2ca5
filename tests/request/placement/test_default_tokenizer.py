"""KV events with no tokenizer configured: the router tokenizes through the engines' own
`/tokenize` (`via: engine`) by default and says so at startup, so a prefix filled behind its
back is found exactly, as with a tokenizer named (issue 52: it silently routed on the guess)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.harness import STARVED_S, Cluster, Proc, backend
from tests.support.wait import wait_for

ENGINE = ["--engine", "--max-num-seqs", "16", "--kv-tokens", "8192", "--decode-ms", "2"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    run = Path(tmp_path_factory.mktemp("kvdefault"))
    c = Cluster()
    try:
        mocks = {
            n: c.mock(n, engine_args=[*ENGINE, "--kv-events", f"ipc://{run}/{n}.sock"])
            for n in ("a", "b")
        }
        router = c.router(
            {
                "backends": [backend(n, m, kv_events={}) for n, m in mocks.items()],
                "balancer": "cache_aware",  # no affinity.tokenizers
                "engine_metrics": {"interval": 0.1, "timeout": 1, "stale_after": 3},
                "expose_backend_header": True,
                "health": {"interval": 60},
            }
        )
        yield {**mocks, "router": router}
    finally:
        c.close()


def chat(base: str, text: str, model: str) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}],
        "max_tokens": 2,
    }
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=20)
    r.raise_for_status()
    return r


def kv(router: Proc) -> dict[str, dict[str, object]]:
    rows = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
    return {r["name"]: r["kv_events_state"] for r in rows}


def test_the_startup_log_names_the_default(fleet: dict[str, Proc]) -> None:
    log = fleet["router"].log()
    assert "model 'm'" in log and "via: engine" in log and "affinity.tokenizers" in log


def test_a_prefix_filled_behind_the_routers_back_is_found_exactly(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    wait_for(lambda: all(s and s["publishers"] for s in kv(router).values()), "feeds found")
    text = "Hidden customer handbook, section by section. " * 60  # ~700 tokens

    def indexed(name: str, before: int) -> bool:
        return int(kv(router)[name]["blocks"]) > before  # type: ignore[call-overload]

    for hidden in ("b", "a"):  # the holder is each engine in turn, not a lucky default
        body = text.replace("Hidden", f"Hidden {hidden}")
        before = int(kv(router)[hidden]["blocks"])  # type: ignore[call-overload]
        chat(fleet[hidden].url, body, "mock-model")  # straight to the engine
        wait_for(lambda h=hidden, n=before: indexed(h, n), "the hidden fill's events")
        r = chat(router.url, body, "m")
        assert r.headers["x-sluicegate-backend"] == hidden
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        assert int(details.get("cached_tokens") or 0) > 600
    metrics = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    assert 'reason="prefix_exact"' in metrics
