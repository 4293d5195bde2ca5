"""The mock's NIXL handoff held to real vLLM's: the same two legs to both, the shapes compared.

Real: the session's engines run NixlConnector as `kv_both` (conftest.py), engine 0 prefills and
engine 1 decodes. Mock: a `--kv-role prefill` and a `--kv-role decode` mock engine. Compared:
the prefill answer's top-level fields and its `kv_transfer_params` (keys, and value types, a
list's by its first item: vLLM gives `remote_block_ids` one list per KV-cache group); the decode
leg's status and what its `vllm:prompt_tokens_by_source_total` moves by; the decode engine's
answer (status, body) to params naming an engine id no prefill engine has; and the metric
families the mock serves for the handoff, which real vLLM must serve with the same type and
labels.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.request.placement.pd import PREFILL_PARAMS
from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster
from tests_engine.support import Words, ensure_healthy, metrics_of, wait_idle

PROMPT_TOKENS = 1500
CMPL = "/v1/completions"
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
LOCAL = "vllm:prompt_tokens_by_source_total{source=local_compute}"


def sig(value: Any) -> Any:
    """Value types: a dict's per key, a list's by its first item (their count varies)."""
    if isinstance(value, dict):
        return {k: sig(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return ["list", sig(value[0])] if value else ["list"]
    return "null" if value is None else type(value).__name__


def _counters(url: str) -> dict[str, float]:
    return metrics_of(httpx.get(url + "/metrics", timeout=10).content)


def _handoff(p: str, d: str, body: dict[str, Any]) -> dict[str, Any]:
    """Both legs as vLLM's toy proxy sends them; what each answered and what D's counters did."""
    rid = f"conform-{uuid.uuid4().hex}"
    headers = {"x-request-id": rid}
    first = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_PARAMS)}
    r1 = httpx.post(p + CMPL, json=first, headers=headers, timeout=60)
    assert r1.status_code == 200, r1.text
    answer = r1.json()
    before = _counters(d)
    r2 = httpx.post(
        d + CMPL,
        json={**body, "kv_transfer_params": answer["kv_transfer_params"]},
        headers=headers,
        timeout=60,
    )
    after = _counters(d)
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (EXTERNAL, LOCAL)}
    return {"prefill": answer, "status": r2.status_code, "decode": r2.json(), "moved": moved}


def mock_tokens(result: dict[str, Any]) -> float:
    return float(result["decode"].get("usage", {}).get("prompt_tokens", -1))


def _unknown_engine(p: str, d: str, body: dict[str, Any]) -> tuple[int, Any, float]:
    """D's answer to params whose engine id no engine has (P's side channel otherwise real)."""
    first = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_PARAMS)}
    params = httpx.post(p + CMPL, json=first, timeout=60).json()["kv_transfer_params"]
    params = {**params, "remote_engine_id": f"nobody-{uuid.uuid4().hex}"}
    began = time.monotonic()
    r = httpx.post(d + CMPL, json={**body, "kv_transfer_params": params}, timeout=60)
    return r.status_code, r.json(), time.monotonic() - began


def _families(url: str) -> dict[str, tuple[str, set[tuple[str, ...]], set[str]]]:
    """Handoff families: (type, label-name sets by sample, `source` values)."""
    out = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith(("vllm:nixl_", "vllm:prompt_tokens_by_source")):
            names = {(s.name, *sorted(s.labels)) for s in fam.samples}
            sources = {s.labels["source"] for s in fam.samples if "source" in s.labels}
            out[fam.name] = (fam.type, names, sources)
    return out


@pytest.fixture(scope="module")
def pairs(engine_fleet: Fleet) -> Any:
    ensure_healthy(engine_fleet)
    p, d = engine_fleet.engines
    model = p.model
    cluster = Cluster()
    try:
        # A failed pull answers after 1 s, not its default 5 s (vLLM: 0.2-0.6 s for an unknown
        # engine id at a live side channel, about 5 s for an unreachable one).
        common = ["--engine", "--served-model-name", model, "--decode-ms", "2"]
        common += ["--kv-fail-delay-ms", "1000"]
        mp = cluster.mock("pd-prefill", engine_args=[*common, "--kv-role", "prefill"])
        md = cluster.mock("pd-decode", engine_args=[*common, "--kv-role", "decode"])
        yield {"real": (p.url, d.url), "mock": (mp.url, md.url), "model": model}
    finally:
        cluster.close()


def test_the_mocks_nixl_handoff_has_vllms_shapes(
    engine_fleet: Fleet, pairs: dict[str, Any]
) -> None:
    wait_idle(engine_fleet.engines)
    words = Words(engine_fleet, seed=2901)
    body = {
        "model": pairs["model"],
        "prompt": words.text(PROMPT_TOKENS),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    got = {k: _handoff(*pairs[k], body) for k in ("real", "mock")}
    real, mock = got["real"], got["mock"]
    tokens = real["prefill"]["usage"]["prompt_tokens"]
    assert tokens >= PROMPT_TOKENS
    real_params = real["prefill"]["kv_transfer_params"]
    assert real_params["do_remote_prefill"] is True and real_params["remote_num_tokens"] == tokens
    print(f"\nvLLM's prefill kv_transfer_params: {real_params}")
    # D takes the whole prompt from P: counted as external, none computed again.
    assert real["status"] == 200, real["decode"]
    assert real["moved"] == {EXTERNAL: tokens, LOCAL: 0.0}
    # Every difference at once (one run of the tier shows all of them).
    mock_params = mock["prefill"]["kv_transfer_params"]
    differences = [
        (what, got, want)
        for what, got, want in [
            ("prefill answer fields", sorted(mock["prefill"]), sorted(real["prefill"])),
            ("kv_transfer_params types", sig(mock_params), sig(real_params)),
            *[
                (f"kv_transfer_params.{k}", mock_params.get(k), real_params[k])
                for k in ("do_remote_prefill", "do_remote_decode", "transfer_mode")
            ],
            ("prefill text given", bool(mock["prefill"]["choices"][0]["text"]), True),
            ("decode status", mock["status"], 200),
            ("decode counters", mock["moved"], {EXTERNAL: mock_tokens(mock), LOCAL: 0.0}),
            ("decode answer types", sig(mock["decode"]), sig(real["decode"])),
        ]
        if got != want
    ]
    assert differences == [], differences


def test_an_unknown_engine_id_gets_vllms_500(engine_fleet: Fleet, pairs: dict[str, Any]) -> None:
    wait_idle(engine_fleet.engines)
    body = {"model": pairs["model"], "prompt": Words(engine_fleet, seed=2902).text(600)}
    body |= {"max_tokens": 4, "temperature": 0}
    real = _unknown_engine(*pairs["real"], body)
    mock = _unknown_engine(*pairs["mock"], body)
    print(f"\nunknown engine id: vLLM 500 after {real[2]:.2f} s, the mock after {mock[2]:.2f} s")
    assert real[0] == mock[0] == 500
    assert mock[1] == real[1]
    ensure_healthy(engine_fleet)  # the decode engine stays up


def _type_lines(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        ln
        for ln in text.splitlines()
        if ln.startswith(("# TYPE vllm:nixl_", "# TYPE vllm:prompt_tokens_by_source"))
    }


def test_the_mocks_handoff_metrics_are_vllms(pairs: dict[str, Any]) -> None:
    # The exposition itself: a family declared under another name than vLLM's (a counter's
    # TYPE line with or without `_total`) parses as another family.
    mine, theirs = _type_lines(pairs["mock"][1]), _type_lines(pairs["real"][1])
    assert mine <= theirs, sorted(mine - theirs)
    real = _families(pairs["real"][1])
    mock = _families(pairs["mock"][1])
    assert "vllm:prompt_tokens_by_source" in mock
    for name, (kind, samples, sources) in mock.items():
        assert name in real, f"{name}: the mock serves it, vLLM does not"
        assert kind == real[name][0], name
        assert samples <= real[name][1], name
        assert sources <= real[name][2], name
    assert {"external_kv_transfer", "local_compute"} <= mock["vllm:prompt_tokens_by_source"][2]
