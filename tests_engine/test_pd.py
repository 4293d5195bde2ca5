"""Prefill/decode disaggregation through sluicegate on real vLLM: NIXL moves the KV for real.

The session's engines run NixlConnector as `kv_both` (conftest.py); the router's config makes
engine 0 the prefill engine (P, core 0) and engine 1 the decode engine (D, core 1). Proven by
D's own counters: a long prompt handed over counts in D's
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` and none in
`local_compute`; one served whole counts in `local_compute` only. The text at temperature 0
equals a direct run on D with a `cache_salt` (D computes it all itself). A prefill engine that
is down is a backend at a port nothing listens on (what a killed engine leaves): killing a real
one would cost a restart (about 35 s) that the next test waits for.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import openai

from router.tools.enginefleet.fleet import Engine, Fleet, free_port
from tests.support.harness import Cluster, Proc, in_flight
from tests.support.wait import wait_for
from tests_engine.support import Words, metrics, start_router, wait_idle

LONG, SHORT = 1500, 40  # prompt tokens: above and far below min_uncached_tokens
MIN_UNCACHED = 512
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
LOCAL = "vllm:prompt_tokens_by_source_total{source=local_compute}"
DISCONNECT_MAX_TOKENS = 500  # with the 1500-token prompt, under max_model_len (2048)
READ_CHUNKS = 5
ATTEMPTS = 4  # streams, for one the client leaves before D's end (see test_disconnect.py)


def _backend(e: Engine, role: str) -> dict[str, Any]:
    return {
        "name": f"engine-{e.index}",
        "url": e.url,
        "kind": "vllm",
        "models": {e.model: e.model},
        "role": role,
        "kv_events": {},  # discovered from the engine's GET /kv_event_sources
    }


def pd_router(procs: Cluster, fleet: Fleet, prefill: list[dict[str, Any]] | None = None) -> Proc:
    """A router splitting the model's long prompts: P (engine 0, or `prefill`), D (engine 1)."""
    p, d = fleet.engines
    prefills = prefill if prefill is not None else [_backend(p, "prefill")]
    config = {
        # The router's own tokenizer counts the prompt (its 4-characters-a-token estimate would
        # call these made-up words, about 1.2 characters a token, short): it tokenizes for
        # cache_aware over backends with KV events, which also tell it what D holds.
        "balancer": "cache_aware",
        "affinity": {"tokenizers": {d.model: {"via": "router", "path": str(d.model_dir)}}},
        "backends": [*prefills, _backend(d, "decode")],
        "disaggregation": {"connector": "nixl", "min_uncached_tokens": MIN_UNCACHED},
    }
    return start_router(procs, fleet, config)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _moved(engine: Engine, before: dict[str, float], *keys: str) -> dict[str, float]:
    now = metrics(engine)
    return {k: now.get(k, 0.0) - before.get(k, 0.0) for k in keys}


def _counted(engine: Engine, before: dict[str, float], tokens: float) -> None:
    """Until the engine's prompt tokens by source (its stats land after the answer) add up to
    `tokens`."""
    wait_for(
        lambda: sum(_moved(engine, before, EXTERNAL, LOCAL).values()) >= tokens,
        f"engine {engine.index} counted {tokens:.0f} prompt tokens",
        10.0,
    )


def _results(router: Proc) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sluicegate_disaggregated_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            result = labels.split('result="')[1].split('"')[0]
            out[result] = out.get(result, 0.0) + float(value)
    return out


def _prefill_count(router: Proc, backend: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("sluicegate_prefill_seconds_count{") and f'"{backend}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _chat(client: openai.OpenAI, model: str, text: str, **extra: Any) -> tuple[str, Any, Any]:
    """(text, usage, the raw first response) of a streamed chat at temperature 0."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **extra},
    )
    chunks = list(raw.parse())
    out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return out, chunks[-1].usage, raw


def test_a_long_prompt_is_handed_over_and_a_short_one_served_whole(
    fleet: Fleet, procs: Cluster
) -> None:
    p, d = fleet.engines
    router = pd_router(procs, fleet)
    words = Words(fleet, seed=2911)
    long_text = words.text(LONG)
    client = sdk(router.url)

    p_before, d_before = metrics(p), metrics(d)
    text, usage, raw = _chat(client, d.model, long_text)
    assert raw.headers["x-sluicegate-backend"] == "engine-1"
    tokens = usage.prompt_tokens
    assert tokens >= LONG
    _counted(d, d_before, tokens)
    assert _moved(d, d_before, EXTERNAL, LOCAL) == {EXTERNAL: tokens, LOCAL: 0.0}
    # P computed the prompt (its one token is not the client's: usage counts D's answer).
    assert _moved(p, p_before, "vllm:prompt_tokens_total")["vllm:prompt_tokens_total"] == tokens
    assert usage.completion_tokens == 24
    # The reference: D alone, computing the whole prompt (the salt keeps P's blocks out).
    reference, ref_usage, _ = _chat(sdk(d.url), d.model, long_text, cache_salt=uuid.uuid4().hex)
    assert text == reference
    assert ref_usage.prompt_tokens == tokens

    # A short prompt goes to D whole: P sees nothing, D computes it.
    p_before, d_before = metrics(p), metrics(d)
    short = client.completions.with_raw_response.create(
        model=d.model, prompt=words.text(SHORT), max_tokens=4, temperature=0
    )
    assert short.headers["x-sluicegate-backend"] == "engine-1"
    n = short.parse().usage.prompt_tokens
    _counted(d, d_before, n)
    assert _moved(d, d_before, EXTERNAL, LOCAL) == {EXTERNAL: 0.0, LOCAL: n}
    assert _moved(p, p_before, "vllm:prompt_tokens_total")["vllm:prompt_tokens_total"] == 0
    assert _results(router) == {"disaggregated": 1.0, "short": 1.0}
    assert _prefill_count(router, "engine-0") == 1
    assert in_flight(router) == 0


def _leave_in_phase_2(router: Proc, fleet: Fleet, seed: int) -> tuple[float, float] | None:
    """(D's tokens generated in all, seconds from the close to nothing running on D) of a
    handed-over stream its client left after READ_CHUNKS; None when D had generated it all by
    the time the client left (a starved client: that try tells nothing)."""
    d = fleet.engines[1]
    wait_idle(fleet.engines)
    before = metrics(d)
    stream = sdk(router.url).completions.create(
        model=d.model,
        prompt=Words(fleet, seed).text(LONG),
        max_tokens=DISCONNECT_MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for read, _ in enumerate(stream, 1):
        if read == READ_CHUNKS:
            break
    ahead = metrics(d)["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    closed = time.monotonic()
    stream.close()
    wait_for(
        lambda: metrics(d)["vllm:num_requests_running"] == 0,
        "D stops the abandoned request",
        within=10.0,
        every=0.01,
    )
    took = time.monotonic() - closed
    time.sleep(0.2)  # the last step's tokens land in the counter
    moved = _moved(d, before, EXTERNAL, "vllm:generation_tokens_total")
    assert moved[EXTERNAL] > 0, "the stream was not handed over"  # phase 2 it was
    generated = moved["vllm:generation_tokens_total"]
    if ahead >= DISCONNECT_MAX_TOKENS or generated >= DISCONNECT_MAX_TOKENS:
        return None
    return generated, took


def test_a_client_leaving_in_phase_2_stops_the_decode_engine(fleet: Fleet, procs: Cluster) -> None:
    router = pd_router(procs, fleet)
    for attempt in range(ATTEMPTS):
        trial = _leave_in_phase_2(router, fleet, seed=2920 + attempt)
        if trial is not None:
            break
    else:
        raise AssertionError(f"no handed-over stream was cut short in {ATTEMPTS} tries")
    generated, took = trial
    print(f"\nD generated {generated:.0f} of {DISCONNECT_MAX_TOKENS}; stopped {took:.2f} s after")
    assert generated < DISCONNECT_MAX_TOKENS
    assert in_flight(router) == 0


def test_a_prefill_engine_down_fails_over_or_leaves_the_decode_engine_whole(
    fleet: Fleet, procs: Cluster
) -> None:
    p, d = fleet.engines
    dead = {
        "name": "prefill-down",
        "url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "kind": "vllm",
        "models": {d.model: d.model},
        "role": "prefill",
    }
    words = Words(fleet, seed=2930)
    # Another prefill engine left: every long prompt is still handed over, through it.
    router = pd_router(procs, fleet, [dead, _backend(p, "prefill")])
    d_before = metrics(d)
    total = 0
    for _ in range(3):
        r = sdk(router.url).completions.with_raw_response.create(
            model=d.model, prompt=words.text(LONG), max_tokens=4, temperature=0
        )
        assert r.headers["x-sluicegate-backend"] == "engine-1"
        total += r.parse().usage.prompt_tokens
    _counted(d, d_before, total)
    assert _moved(d, d_before, EXTERNAL, LOCAL) == {EXTERNAL: total, LOCAL: 0.0}
    assert _results(router) == {"disaggregated": 3.0}
    assert _prefill_count(router, "engine-0") == 3 and _prefill_count(router, "prefill-down") == 0
    # Whether it was tried first (and failed over) or left out by health already is the
    # balancer's and the probes' timing; either way no request failed.
    page = httpx.get(router.url + "/metrics", timeout=10).text
    tried = [ln for ln in page.splitlines() if ln.startswith("sluicegate_upstream_errors_total{")]
    print(f"\nattempts failed: {tried}")

    # No prefill engine left: D serves the long prompt whole.
    router = pd_router(procs, fleet, [dead])
    d_before = metrics(d)
    r = sdk(router.url).completions.with_raw_response.create(
        model=d.model, prompt=words.text(LONG), max_tokens=4, temperature=0
    )
    assert r.headers["x-sluicegate-backend"] == "engine-1"
    n = r.parse().usage.prompt_tokens
    _counted(d, d_before, n)
    assert _moved(d, d_before, EXTERNAL, LOCAL) == {EXTERNAL: 0.0, LOCAL: n}
    results = _results(router)
    assert sum(results.values()) == 1 and "disaggregated" not in results, results
