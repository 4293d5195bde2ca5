"""The Batch API against the real vLLM engines (issue 51): a 200-line job through the official
openai SDK's files and batches calls, with an interactive client streaming alongside. The job
completes with each custom_id once; every interactive request succeeds; and the batch yields:
interactive requests that found every slot taken waited in admission's queue (the router's own
histogram) while the runner started no line (its yield counter). Timing figures (interactive
TTFT with the job running against idle, the batch's tokens/s against the engines flat out) are
in the benchmark: `python -m bench.run --only batch_real`."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import openai

from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster, metric
from tests.support.wait import wait_for
from tests_engine.support import backends, start_router, wait_idle

LINES = 200
LINE_TOKENS = 8
# Two engines x 4 slots; batch work may hold 3 per engine, so the interactive client's 4 streams
# find every slot taken whenever the runner has filled its share, and wait in the queue.
SLOTS, PER_ENGINE, STREAMS = 4, 3, 4
JOB_TIMEOUT_S = 120.0  # a bound only: the job takes ~10-20 s; a loaded machine is far slower


def test_a_200_line_job_completes_beside_interactive_traffic_and_yields_to_it(
    fleet: Fleet, procs: Cluster
) -> None:
    redis = procs.redis()
    model = fleet.engines[0].model
    router = start_router(
        procs,
        fleet,
        {
            "backends": backends(fleet, max_inflight=SLOTS),
            "redis_url": redis.url,
            "admission": {"max_wait": 60},
            "batch": {
                "storage_dir": str(procs.tmp / "batch"),
                "tick": 0.05,
                "per_engine": PER_ENGINE,
            },
        },
    )
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"batch item {i}: summarise it"}],
                "max_tokens": LINE_TOKENS,
                "temperature": 0,
            },
        }
        for i in range(LINES)
    ]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    f = c.files.create(file=("job.jsonl", data), purpose="batch")
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    stop = threading.Event()
    outcomes: list[str] = []  # "ok", or what went wrong

    def interactive(k: int) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S + 10
        for n in range(500):  # bounded in count and time
            if stop.is_set() or time.monotonic() > deadline:
                return
            try:
                stream = c.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"interactive {k}.{n}"}],
                    max_tokens=16,
                    stream=True,
                )
                text = "".join(
                    chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
                )
                outcomes.append("ok" if text else "empty answer")
            except openai.APIError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")

    clients = [threading.Thread(target=interactive, args=(k,)) for k in range(STREAMS)]
    for t in clients:
        t.start()
    try:
        wait_for(
            lambda: c.batches.retrieve(job.id).status in ("completed", "failed", "expired"),
            "the 200-line job ends",
            JOB_TIMEOUT_S,
            0.2,
        )
    finally:
        stop.set()
        for t in clients:
            t.join(60)
    done = c.batches.retrieve(job.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
    out = [json.loads(r) for r in c.files.content(done.output_file_id or "").content.splitlines()]
    assert Counter(r["custom_id"] for r in out) == Counter(x["custom_id"] for x in lines)
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] >= 1 for r in out)

    assert outcomes and set(outcomes) == {"ok"}, Counter(outcomes).most_common(5)
    # The batch yielded: interactive requests waited for a slot in the router's queue, and on
    # those ticks the runner started no line (they went first).
    assert metric(router, "sluicegate_queue_wait_seconds_count", priority="standard") >= 1
    assert metric(router, "sluicegate_batch_yields_total") >= 1
    assert metric(router, "sluicegate_batch_lines_total", outcome="completed") == LINES
    assert metric(router, "sluicegate_batch_inflight") == 0
    wait_idle(fleet.engines)  # nothing left running on the engines
