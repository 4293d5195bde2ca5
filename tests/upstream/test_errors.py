"""Connect failures are 502, timeouts 504, both in OpenAI format, with nothing left counted."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.harness import Cluster, backend, control, free_port


def test_connect_failure_is_502(procs: Cluster) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = procs.router({"backends": [{"name": "dead", "url": dead, "models": ["m"]}]})
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_connect_error"
    assert dead not in r.text
    rows = httpx.get(router.url + "/admin/backends").json()
    assert rows[0]["in_flight"] == 0
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        c.chat.completions.create(model="m", messages=[], stream=True)
    assert info.value.status_code == 502


def test_silent_upstream_times_out_with_504(procs: Cluster) -> None:
    up = procs.mock("hang")
    control(up, hang=True)
    router = procs.router(
        {
            "backends": [backend("hang", up)],
            "timeouts": {"connect": 1, "read": 0.5, "write": 1, "pool": 1},
            "retries": {"attempts": 1},
        }
    )
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert httpx.get(router.url + "/admin/backends").json()[0]["in_flight"] == 0


def test_mid_stream_silence_ends_with_timeout_event(procs: Cluster) -> None:
    up = procs.mock("stall", ttft_ms=0, itl_ms=1500, tokens=5)
    router = procs.router(
        {
            "backends": [backend("stall", up)],
            "timeouts": {"connect": 1, "read": 0.5, "write": 1, "pool": 1},
        }
    )
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={"model": "m", "stream": True}, timeout=10
    ) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    # vLLM's role-only event, then the first token, then the silence.
    assert '"role":"assistant"' in events[0] and events[1].count("tok0") == 1
    assert '"upstream_timeout"' in events[-2] and events[-1] == "data: [DONE]"
