"""`batch.preempt`: a batch line in flight is cancelled for an interactive request waiting in
admission's queue, handed back and run again; the job still ends with each custom_id once."""

from __future__ import annotations

import json
from collections import Counter

import openai

from tests.batch.test_batches import chat_line, jsonl
from tests.support.harness import STARVED_S, Cluster, backend, control, metric, stats
from tests.support.wait import wait_for

# A batch line's answer: 100 tokens at 100 ms, 10 s, so that no line can end by itself (and give
# the interactive request its slot without a preemption) however starved the machine is while the
# test sends that request; the interactive request asks for one token.
LINE_TOKENS, ITL_MS = 100, 100


def test_a_waiting_interactive_request_preempts_the_youngest_batch_line(procs: Cluster) -> None:
    redis = procs.redis()
    mock = procs.mock(itl_ms=ITL_MS, tokens=LINE_TOKENS)
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
        file=("in.jsonl", jsonl([chat_line(i, max_tokens=LINE_TOKENS) for i in range(2)])),
        purpose="batch",
    )
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(lambda: stats(mock)["running"] == 2, "both slots held by batch lines")
    answer = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "now"}], max_tokens=1
    )
    assert answer.choices[0].message.content
    # Answered while both lines were still generating: it did not wait for one to end.
    assert stats(mock)["completed"] == 1, stats(mock)
    assert metric(router, "sluicegate_batch_lines_total", outcome="preempted") >= 1
    control(mock, itl_ms=0)  # the handed-back line's second run need not take 10 s
    wait_for(
        lambda: c.batches.retrieve(job.id).status == "completed",
        "the job completes",
        STARVED_S,
        0.2,
    )
    done = c.batches.retrieve(job.id)
    assert done.request_counts.completed == 2
    rows = c.files.content(done.output_file_id or "").content.splitlines()
    assert Counter(json.loads(r)["custom_id"] for r in rows) == Counter(["req-0", "req-1"])
