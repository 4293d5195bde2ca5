"""The fleet itself: engines answer, on loopback, with the settings the tier relies on."""

from __future__ import annotations

import openai

from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster
from tests_engine.conftest import FLEET_OPTIONS
from tests_engine.support import cache_config, start_router


def test_engines_serve_the_tiny_model_and_a_router_in_front_of_them(
    fleet: Fleet, procs: Cluster
) -> None:
    for e in fleet.engines:
        assert e.url.startswith("http://127.0.0.1:")
        info = cache_config(e)
        assert info["enable_prefix_caching"] == "True"
        assert int(info["num_gpu_blocks"]) == FLEET_OPTIONS.kv_blocks
        client = openai.OpenAI(base_url=e.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [e.model]

    router = start_router(procs, fleet)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model=fleet.engines[0].model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert out.usage is not None and out.usage.completion_tokens > 0
    assert out.choices[0].message.content
