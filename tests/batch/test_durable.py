"""A batch job survives its router: SIGKILLed mid-job and restarted on the same Redis and
storage it completes with every custom_id once; two replicas share one job's lines; a cancel
stops new lines within one tick and keeps what finished, the rest marked."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import openai

from tests.batch.test_batches import chat_line, jsonl
from tests.support.harness import Cluster, Proc, backend, metric, stats
from tests.support.wait import wait_for

TICK = 0.05
LEASE = 1.0  # s: a dead replica's lines are taken again this long after its last renewal


def config(procs: Cluster, redis: Proc, mock: Proc, **batch: Any) -> dict[str, Any]:
    return {
        "backends": [backend("a", mock)],
        "redis_url": redis.url,
        "batch": {
            "storage_dir": str(procs.tmp / "batch"),
            "tick": TICK,
            "lease_ttl": LEASE,
            "per_engine": 4,
            **batch,
        },
    }


def submit(router: Proc, n: int) -> tuple[openai.OpenAI, str]:
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    f = c.files.create(
        file=("in.jsonl", jsonl([chat_line(i, max_tokens=2) for i in range(n)])), purpose="batch"
    )
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return c, job.id


def rows(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).content.splitlines()]


def test_sigkilled_mid_job_the_restarted_router_completes_it_each_line_once(
    procs: Cluster,
) -> None:
    redis = procs.redis()
    mock = procs.mock(ttft_ms=60, tokens=2)
    cfg = config(procs, redis, mock)
    first = procs.router(cfg)
    c, job_id = submit(first, 60)
    wait_for(lambda: c.batches.retrieve(job_id).request_counts.completed >= 12, "a fifth done")
    first.kill9()
    assert c.batches  # the client outlives the router
    second = procs.router(cfg)
    c2 = openai.OpenAI(base_url=second.url + "/v1", api_key="none", max_retries=0)
    wait_for(lambda: c2.batches.retrieve(job_id).status == "completed", "the job completes")
    done = c2.batches.retrieve(job_id)
    assert done.request_counts.completed == 60 and done.request_counts.failed == 0
    ids = Counter(r["custom_id"] for r in rows(c2, done.output_file_id))
    assert ids == Counter(f"req-{i}" for i in range(60))
    assert rows(c2, done.error_file_id) == []


def test_two_replicas_share_one_jobs_lines(procs: Cluster) -> None:
    redis = procs.redis()
    mock = procs.mock(ttft_ms=40, tokens=2)
    cfg = config(procs, redis, mock, per_engine=2)
    one, two = procs.router(cfg), procs.router(cfg)
    c, job_id = submit(one, 40)
    wait_for(lambda: c.batches.retrieve(job_id).status == "completed", "the job completes")
    done = c.batches.retrieve(job_id)
    assert done.request_counts.completed == 40
    ids = Counter(r["custom_id"] for r in rows(c, done.output_file_id))
    assert ids == Counter(f"req-{i}" for i in range(40))
    ran = [metric(p, "sluicegate_batch_lines_total", outcome="completed") for p in (one, two)]
    assert all(n > 0 for n in ran) and sum(ran) == 40, ran


def test_cancel_stops_new_lines_within_a_tick_and_keeps_what_finished(procs: Cluster) -> None:
    redis = procs.redis()
    mock = procs.mock(ttft_ms=100, tokens=2)
    router = procs.router(config(procs, redis, mock, per_engine=3))
    c, job_id = submit(router, 60)
    wait_for(lambda: c.batches.retrieve(job_id).request_counts.completed >= 6, "some done")
    job = c.batches.cancel(job_id)
    sent_at_cancel = stats(mock)["requests"]
    assert job.status in ("cancelling", "cancelled")
    wait_for(lambda: c.batches.retrieve(job_id).status == "cancelled", "the job is cancelled")
    # Only lines in flight at the cancel (at most per_engine) or started within the tick that
    # was under way may reach the engine after it.
    assert stats(mock)["requests"] - sent_at_cancel <= 3 * 2
    done = c.batches.retrieve(job_id)
    assert done.cancelled_at is not None and done.request_counts.total == 60
    kept, marked = rows(c, done.output_file_id), rows(c, done.error_file_id)
    assert len(kept) == done.request_counts.completed < 60
    assert {r["error"]["code"] for r in marked} == {"batch_cancelled"}
    ids = Counter(r["custom_id"] for r in kept + marked)
    assert ids == Counter(f"req-{i}" for i in range(60))
