"""LoRA adapters: readings, adapter-aware choice, and the router against mock engines with slots.

The end-to-end part runs three mock vLLM engines with LoRA (`--max-loras 2`) and a real router
(`least_load`, load on demand on): scrape interval 0.1 s and adapter refresh 0.2 s, so every
wait is a poll with a deadline of a few of those.
"""

from __future__ import annotations

import concurrent.futures
import io
import re
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
import pytest
from openai import NotFoundError, OpenAI

from balancers.base import Candidate
from balancers.cache_aware import CacheAware, Hints
from balancers.context import AdapterWant, PickContext
from balancers.least_load import LeastLoad
from balancers.lora import Tier, tier
from router.core.engine import EngineReading
from router.engine.adapters import adapters_of, base_models
from router.engine.parse import MAX_LORA_SERIES, parse
from router.request.placement.prefix import block_hashes
from router.tools.status import run as status
from tests.support.harness import STARVED_S, Cluster, Proc, backend, stats
from tests.support.picking import Bound
from tests.support.wait import wait_for

LAB = '{engine="0",model_name="m"}'


def page(*lora_lines: str) -> bytes:
    text = f"vllm:num_requests_running{LAB} 1.0\nvllm:num_requests_waiting{LAB} 0.0\n"
    return (text + "".join(line + "\n" for line in lora_lines)).encode()


def info(running: str, waiting: str, at: float, max_lora: int = 2) -> str:
    return (
        f'vllm:lora_requests_info{{max_lora="{max_lora}",waiting_lora_adapters="{waiting}",'
        f'running_lora_adapters="{running}"}} {at}'
    )


# --- readings ---------------------------------------------------------------------------------


def test_the_newest_lora_series_is_the_current_one() -> None:
    text = page(info("a,b", "a,b", 1.7e9 + 5), info("c", "", 1.7e9 + 9), info("a", "", 1.7e9))
    parsed = parse(text, "vllm")
    assert parsed.lora == (2, frozenset({"c"}), frozenset())
    parsed = parse(page(info("a", "a,b", 2.0)), "vllm")
    assert parsed.lora == (2, frozenset({"a"}), frozenset({"a", "b"}))
    assert parse(page(), "vllm").lora is None  # no --enable-lora


def test_too_many_lora_series_drop_the_lora_part_not_the_reading() -> None:
    many = [info(f"x{i}", "", float(i)) for i in range(MAX_LORA_SERIES + 1)]
    parsed = parse(page(*many), "vllm")
    assert parsed.lora is None
    assert parsed.running == 1.0


def test_adapters_are_the_entries_whose_parent_is_the_base_model() -> None:
    body = (
        b'{"data": [{"id": "m", "parent": null}, {"id": "sql", "parent": "m"},'
        b' {"id": "other", "parent": "elsewhere"}, {"id": "bad name", "parent": "m"}]}'
    )
    assert adapters_of(body, {"m"}) == {"sql"}
    listed = [{"id": "m", "parent": None}, {"id": "sql", "parent": "m"}]
    assert [e["id"] for e in base_models(listed)] == ["m"]  # models: auto keeps the base


# --- choice -----------------------------------------------------------------------------------


def reading(
    running: float = 0.0,
    adapters: set[str] | None = None,
    lora_running: set[str] = frozenset(),  # type: ignore[assignment]
    lora_waiting: set[str] = frozenset(),  # type: ignore[assignment]
    max_lora: int | None = 2,
) -> EngineReading:
    return EngineReading(
        0.0,
        running,
        0.0,
        None,
        None,
        1.0,
        1,
        max_lora=max_lora,
        lora_running=frozenset(lora_running),
        lora_waiting=frozenset(lora_waiting),
        adapters=frozenset(adapters) if adapters is not None else None,
    )


def test_tiers_running_then_free_slot_then_waiting() -> None:
    want = AdapterWant("sql")
    assert tier(reading(adapters={"sql"}, lora_running={"sql"}), want, "x") is Tier.RUNNING
    assert tier(reading(adapters={"sql"}, lora_running={"a"}), want, "x") is Tier.SLOT
    full = reading(adapters={"sql"}, lora_running={"a", "b"})
    assert tier(full, want, "x") is Tier.WAITING
    assert tier(reading(adapters={"a"}), want, "x") is Tier.LOAD
    # vLLM 0.32 lists every adapter with requests under both labels: within max_lora they all
    # run; past it, some only wait, so none of them counts as running.
    both = {"sql", "a"}
    assert tier(reading(0, {"sql"}, both, both), want, "x") is Tier.RUNNING
    three = {"sql", "a", "b"}
    assert tier(reading(0, {"sql"}, three, three), want, "x") is Tier.WAITING
    # Same load: running beats a slot, a slot beats waiting.
    cands = [
        Candidate("slot", 1.0, 0, reading(1, {"sql"}, {"a"})),
        Candidate("run", 1.0, 0, reading(1, {"sql"}, {"sql"})),
        Candidate("wait", 1.0, 0, reading(1, {"sql"}, {"a", "b"})),
    ]
    picker = Bound(LeastLoad(), PickContext(adapter=want))
    choice = picker.pick(cands)
    assert choice is not None and (choice.candidate.name, choice.reason) == (
        "run",
        "adapter_running",
    )
    assert picker.pick(cands, {"run"}).candidate.name == "slot"  # type: ignore[union-attr]
    assert picker.pick(cands, {"run", "slot"}).candidate.name == "wait"  # type: ignore[union-attr]
    # Much busier: a free slot elsewhere wins over running it.
    busy = [Candidate("run", 1.0, 0, reading(8, {"sql"}, {"sql"})), cands[0]]
    assert picker.pick(busy).candidate.name == "slot"  # type: ignore[union-attr]


def test_an_engine_without_the_adapter_is_never_chosen_unless_loading_on_demand() -> None:
    idle = Candidate("idle", 1.0, 0, reading(0, {"a"}))
    holder = Candidate("holder", 1.0, 0, reading(30, {"sql"}, {"sql"}))
    for on_demand in (False, True):
        want = AdapterWant("sql", on_demand=on_demand)
        for picker in (
            Bound(LeastLoad(), PickContext(adapter=want)),
            Bound(
                CacheAware(),
                PickContext(hints=Hints(1, 64, {"idle": 1}), load_factor=1.25, adapter=want),
            ),
        ):
            assert picker.pick([idle, holder]).candidate.name == "holder"  # type: ignore[union-attr]
            # The holder left (a failed attempt): only loading it elsewhere can serve it.
            other = picker.pick([idle, holder], {"holder"})
            assert (other.candidate.name if other else None) == ("idle" if on_demand else None)
    # Nobody serves it: without load on demand nobody takes it; with it, the most room does.
    fuller = Candidate("fuller", 1.0, 0, reading(0, {"a", "b"}, {"a", "b"}))
    assert LeastLoad().pick([idle, fuller], PickContext(adapter=AdapterWant("sql"))) is None
    choice = LeastLoad().pick(
        [idle, fuller], PickContext(adapter=AdapterWant("sql", on_demand=True))
    )
    assert choice is not None and (choice.candidate.name, choice.reason) == ("idle", "adapter_load")
    # A failed load there counts for that engine and adapter only.
    failed = AdapterWant("sql", on_demand=True, failed=frozenset({"idle"}))
    assert (
        Bound(LeastLoad(), PickContext(adapter=failed)).pick([idle, fuller]).candidate.name
        == "fuller"
    )  # type: ignore[union-attr]
    norole = Candidate("no-lora", 1.0, 0, reading(0, set(), max_lora=None))
    assert Bound(LeastLoad(), PickContext(adapter=failed)).pick([norole]) is None


def test_prefix_blocks_are_keyed_by_adapter() -> None:
    text = "x" * 256
    base, sql, other = (block_hashes(text, 64, s) for s in ("", "sql", "other"))
    assert len(base) == len(sql) == 4
    assert not set(base) & set(sql) and not set(sql) & set(other)
    assert block_hashes(text, 64) == base


# --- end to end -------------------------------------------------------------------------------

ENGINE = ["--engine", "--max-num-seqs", "8", "--decode-ms", "2", "--max-loras", "2"]
ENGINE += ["--lora-load-ms", "300"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    adapter_dir = tmp_path_factory.mktemp("adapters")
    (adapter_dir / "sql").mkdir()
    (adapter_dir / "chat").mkdir()
    c = Cluster()
    try:
        a = c.mock("a", engine_args=[*ENGINE, "--lora-modules", f"sql={adapter_dir / 'sql'}"])
        b = c.mock("b", engine_args=ENGINE)
        e = c.mock("e", engine_args=ENGINE)
        router = c.router(
            {
                "backends": [backend(n, m) for n, m in (("a", a), ("b", b), ("e", e))],
                "balancer": "least_load",
                "engine_metrics": {"interval": 0.1, "timeout": 0.5, "stale_after": 2.0},
                "expose_backend_header": True,
                "health": {"interval": 60},
                "lora": {
                    "load_on_demand": True,
                    "sources": {"chat": str(adapter_dir / "chat"), "broken": "/nonexistent"},
                    "base_model": "m",
                    "refresh": 0.2,
                    "idle_unload": 3.0,
                    "load_timeout": 5,
                },
            }
        )
        yield {"a": a, "b": b, "e": e, "router": router}
    finally:
        c.close()


def ask(router: Proc, model: str) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=STARVED_S,
    )


def lora_metric(router: Proc, adapter: str, result: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sluicegate_lora_loads_total{") and f'adapter="{adapter}"' in line:
            if f'result="{result}"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def engines(router: Proc) -> dict[str, Any]:
    rows = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
    return {r["name"]: r["engine"] for r in rows}


def test_adapter_requests_land_on_the_engine_that_has_it(fleet: dict[str, Any]) -> None:
    router = fleet["router"]
    wait_for(
        lambda: "sql" in (engines(router)["a"].get("lora") or {}).get("loaded", []),
        "the router reads a's adapters",
    )
    client = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    for _ in range(6):
        raw = client.chat.completions.with_raw_response.create(
            model="sql", messages=[{"role": "user", "content": "select"}], max_tokens=2
        )
        assert raw.headers["x-sluicegate-backend"] == "a"
    assert [r["model"] for r in stats(fleet["a"])["recent"]][-6:] == ["sql"] * 6
    for name in ("b", "e"):
        assert "sql" not in [r["model"] for r in stats(fleet[name])["recent"]]
    # Base-model traffic still spreads.
    seen = {ask(router, "m").headers["x-sluicegate-backend"] for _ in range(12)}
    assert len(seen) > 1
    # An adapter nobody serves (and not in lora.sources) is the client's error.
    with pytest.raises(NotFoundError):
        client.chat.completions.create(
            model="nobody-has-it", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )


def test_status_and_admin_show_each_engines_adapters(fleet: dict[str, Any]) -> None:
    lora = engines(fleet["router"])["a"]["lora"]
    assert lora["max_lora"] == 2 and "sql" in lora["loaded"]
    assert set(lora) == {"max_lora", "loaded", "running", "waiting"}
    out = io.StringIO()
    assert status(fleet["router"].url, out=out) == 0
    text = out.getvalue()
    assert "LORA ADAPTERS" in text
    assert re.search(r"^a  loaded [^ ]*sql[^ ]*  running .*  max 2$", text, re.M), text


def test_an_unknown_adapter_is_loaded_once_on_demand_and_unloaded_when_idle(
    fleet: dict[str, Any],
) -> None:
    router = fleet["router"]
    mocks = [fleet[n] for n in ("a", "b", "e")]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: ask(router, "chat"), range(8)))
    # A later request (well within idle_unload) goes where it is loaded, with no new load.
    again = ask(router, "chat")
    assert [r.status_code for r in answers] == [200] * 8, answers[0].text
    where = {r.headers["x-sluicegate-backend"] for r in answers}
    assert len(where) == 1  # concurrent requests waited for the one load
    assert again.headers["x-sluicegate-backend"] in where
    assert sum(stats(m)["lora_runtime_loads"] for m in mocks) == 1
    assert lora_metric(router, "chat", "loaded") == 1
    # Idle for idle_unload: unloaded, and the engine no longer lists it.
    holder = fleet[where.pop()]
    wait_for(lambda: lora_metric(router, "chat", "unloaded") == 1, "the idle unload")
    models = httpx.get(holder.url + "/v1/models", timeout=STARVED_S).json()["data"]
    assert "chat" not in [m["id"] for m in models]


def test_a_failed_load_fails_that_adapter_only(fleet: dict[str, Any]) -> None:
    router = fleet["router"]
    r = ask(router, "broken")
    assert r.status_code == 502
    assert "Loading LoRA adapter `broken`" in r.json()["error"]["message"]
    assert lora_metric(router, "broken", "failed") >= 1
    # The engines stay healthy and keep serving the base model and other adapters.
    rows = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
    assert all(row["healthy"] for row in rows), rows
    assert ask(router, "m").status_code == 200
    assert ask(router, "sql").status_code == 200


def test_the_mock_answers_the_load_endpoints_as_vllm(fleet: dict[str, Any], tmp_path: Path) -> None:
    b = fleet["b"]
    url = b.url + "/v1/load_lora_adapter"
    r = httpx.post(url, json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=STARVED_S)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'x' added successfully.")
    again = httpx.post(url, json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=STARVED_S)
    assert (
        again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    )
    listed = {m["id"]: m for m in httpx.get(b.url + "/v1/models", timeout=STARVED_S).json()["data"]}
    assert listed["x"]["parent"] == "mock-model" and listed["x"]["root"] == str(tmp_path)
    gone = httpx.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=STARVED_S)
    assert gone.status_code == 200
    missing = httpx.post(
        b.url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=STARVED_S
    )
    assert missing.status_code == 404


def test_adapter_routes_follow_the_base_model_through_swaps_and_patches() -> None:
    from router.core.backend import Backend as B
    from router.registry.fleet import Registry

    def be(name: str, models: dict[str, str]) -> B:
        return B(name, f"http://127.0.0.1:{9000 + len(name)}", "vllm", MappingProxyType(models))

    reg = Registry([be("a", {"m": "base"}), be("b", {"m": "base"})], "least_load")
    reg.set_adapters({"sql": "m", "m": "m", "orphan": "nope"})
    snap = reg.snapshot
    assert [b.name for b in snap.by_model["sql"]] == ["a", "b"]
    assert dict(snap.adapters) == {"sql": "m"}  # a configured model wins; no base, no route
    assert "sql" in snap.models
    reg.patch([be("c", {"m": "base"})], ["a"])
    assert [b.name for b in reg.snapshot.by_model["sql"]] == ["b", "c"]
    reg.swap([be("d", {"m": "base"})])
    assert [b.name for b in reg.snapshot.by_model["sql"]] == ["d"]
    reg.set_adapters({})
    assert "sql" not in reg.snapshot.by_model and not reg.snapshot.adapters


def test_every_balancer_and_a_first_contract_plugin_take_the_adapter_from_the_context() -> None:
    """The adapter reaches every policy in its pick context: those that do not weigh adapters
    (round robin, least in flight, a plugin written to `pick(candidates, exclude)`) choose only
    among the engines serving it, and the choice carries the adapter tier's reason."""
    from balancers import balancer_type
    from balancers.least_inflight import LeastInflight
    from balancers.plugin import adapted
    from balancers.round_robin import RoundRobin

    class FirstOffered:
        name = "first"

        def pick(
            self, candidates: list[Candidate], exclude: frozenset[str] = frozenset()
        ) -> object:
            return next((c for c in candidates if c.name not in exclude), None)

    without = Candidate("without", 1.0, 0, reading(0, {"a"}))
    serving = Candidate("serving", 1.0, 5, reading(0, {"sql"}, {"sql"}))
    ctx = PickContext(adapter=AdapterWant("sql"))
    for bal in (
        RoundRobin(),
        LeastInflight(),
        adapted(FirstOffered, "first")(),
        balancer_type("least_load")(),
    ):
        for _ in range(3):
            choice = bal.pick([without, serving], ctx)
            assert choice is not None and choice.candidate.name == "serving", bal
            assert choice.reason == "adapter_running", bal
        assert bal.pick([without, serving], PickContext({"serving"}, adapter=ctx.adapter)) is None
        # Without an adapter the same policy takes any engine.
        plain = {bal.pick([without, serving]).candidate.name for _ in range(4)}  # type: ignore[union-attr]
        assert "without" in plain, bal
