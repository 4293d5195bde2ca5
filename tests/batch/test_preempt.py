"""`batch.preempt`: a batch line in flight is cancelled for an interactive request waiting in
admission's queue, handed back and run again; the job still ends with each custom_id once."""

from __future__ import annotations

import json
import time
from collections import Counter

import openai

from tests.batch.test_batches import chat_line, jsonl
from tests.support.harness import Cluster, backend, metric, stats
from tests.support.wait import wait_for

TTFT_S = 1.0  # the engine's time to answer: what an interactive request would wait for a slot


def test_a_waiting_interactive_request_preempts_the_youngest_batch_line(procs: Cluster) -> None:
    redis = procs.redis()
    mock = procs.mock(ttft_ms=TTFT_S * 1000, tokens=1)
    router = procs.router(
        {
            "backends": [backend("a", mock, max_inflight=2)],
            "redis_url": redis.url,
            "admission": {"max_wait": 10},
            "batch": {
                "storage_dir": str(procs.tmp / "batch"),
                "tick": 0.05,
                "per_engine": 2,
                "preempt": True,
            },
        }
    )
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    f = c.files.create(
        file=("in.jsonl", jsonl([chat_line(i, max_tokens=1) for i in range(2)])), purpose="batch"
    )
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(lambda: stats(mock)["running"] == 2, "both slots held by batch lines")
    began = time.monotonic()
    answer = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "now"}], max_tokens=1
    )
    waited = time.monotonic() - began
    assert answer.choices[0].message.content
    # Without preemption it waits for a batch line to end (about TTFT_S) and then its own TTFT_S.
    assert waited < 1.8 * TTFT_S, waited
    assert metric(router, "sluicegate_batch_lines_total", outcome="preempted") >= 1
    wait_for(lambda: c.batches.retrieve(job.id).status == "completed", "the job completes")
    done = c.batches.retrieve(job.id)
    assert done.request_counts.completed == 2
    rows = c.files.content(done.output_file_id or "").content.splitlines()
    assert Counter(json.loads(r)["custom_id"] for r in rows) == Counter(["req-0", "req-1"])
