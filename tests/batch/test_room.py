"""A batch line's pick: only among the engines whose readings show room (`batch.room_waiting`,
`batch.room_kv_usage`), whichever engine the balancer would choose otherwise."""

from __future__ import annotations

import json

import httpx
import openai

from tests.batch.test_batches import chat_line, jsonl
from tests.support.harness import STARVED_S, Cluster, backend, stats
from tests.support.wait import wait_for

# An engine of one slot kept busy by three hidden sequences: two always wait in its queue.
QUEUED = ["--engine", "--max-num-seqs", "1", "--background", "3", "--background-tokens", "100000"]
LINES = 8


def test_batch_lines_run_only_on_engines_whose_readings_show_room(procs: Cluster) -> None:
    redis = procs.redis()
    full = procs.mock("full", tokens=2, engine_args=QUEUED)
    free = procs.mock("free", tokens=2, engine_args=["--engine"])
    router = procs.router(
        {
            # Round robin alternates whatever the load: without the restriction half the lines
            # would land on the full engine.
            "balancer": "round_robin",
            "backends": [backend("full", full), backend("free", free)],
            "redis_url": redis.url,
            "engine_metrics": {"interval": 0.05, "stale_after": 30.0},
            "batch": {"storage_dir": str(procs.tmp / "batch"), "tick": 0.05, "per_engine": 4},
        }
    )

    def read() -> bool:
        r = httpx.get(router.url + "/admin/backends", timeout=STARVED_S)
        seen = {row["name"]: row["engine"] for row in r.json()}
        full, free = seen["full"], seen["free"]
        return full is not None and full["waiting"] >= 1 and free is not None

    wait_for(read, "fresh readings of both engines, the full one queueing")
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    f = c.files.create(
        file=("in.jsonl", jsonl([chat_line(i, max_tokens=2) for i in range(LINES)])),
        purpose="batch",
    )
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # Where the lines ran is the point, not how soon: 10 s fell short at load average 16.
    wait_for(
        lambda: c.batches.retrieve(job.id).status == "completed", "the job completes", STARVED_S
    )
    done = c.batches.retrieve(job.id)
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
    rows = [json.loads(r) for r in c.files.content(done.output_file_id or "").content.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(LINES))
    assert stats(full)["requests"] == 0  # no line reached the engine with a queue
    assert stats(free)["requests"] == LINES
