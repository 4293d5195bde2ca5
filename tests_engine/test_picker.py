"""`sluicegate epp` behind a real Envoy, in front of the two real vLLM engines.

The same launchers as tests/picker/ (tests/support/picker.py: the picker, and Envoy loading the
shipped examples/endpoint-picker/envoy.yaml); the official openai SDK talks to Envoy, which asks
the picker for an engine and sends the request there itself. One streamed and one whole answer:
the stream comes whole (its usage event, then `[DONE]`), the picker sees both to their end (its
in-flight counts back to 0, both counted in `sluicegate_requests_total`).
"""

from __future__ import annotations

import json

import openai

from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster, metric
from tests.support.picker import envoy_in_front, in_flight, start_picker
from tests.support.wait import wait_for
from tests_engine.support import backends

PROMPT = [{"role": "user", "content": "Count from one to ten."}]


def test_one_stream_and_one_whole_answer_through_envoy_and_the_picker(
    fleet: Fleet, procs: Cluster
) -> None:
    picker = start_picker(
        procs, {"backends": backends(fleet), "health": {"interval": 0.5}, "balancer": "least_load"}
    )
    envoy = envoy_in_front(procs, picker)
    model = fleet.engines[0].model
    client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=PROMPT,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        assert raw.status_code == 200
        assert raw.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in raw.iter_lines() if line]
    assert events[-1] == "[DONE]"  # the stream came whole
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert text and usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0

    whole = client.chat.completions.create(
        model=model,
        messages=PROMPT,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    assert whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens > 0

    wait_for(lambda: set(in_flight(picker).values()) == {0}, "the picker's in-flight back to 0")
    wait_for(
        lambda: metric(picker, "sluicegate_requests_total", status="200") == 2,
        "both requests counted by the picker",
    )
    assert metric(picker, "sluicegate_requests_total") == 2
