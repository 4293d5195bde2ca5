"""A batch job survives its router: SIGKILLed mid-job and restarted on the same Redis and
storage it completes with every custom_id once; two replicas share one job's lines; a cancel
stops new lines within one tick and keeps what finished, the rest marked.

One redis-server, one mock engine and two routers for the module (router starts dominate the
time on a loaded machine); the last test stops one and kills the other."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.batch.test_batches import chat_line, jsonl
from tests.support.harness import STARVED_S, Cluster, Proc, backend, metric
from tests.support.wait import wait_for

TICK = 0.05
LEASE = 1.0  # s: a dead replica's lines are taken again this long after its last renewal
PER_ENGINE = 4  # lines in flight per replica (one engine)
# s: bounds only a job that never ends. Its lines run through two routers on one engine, a
# fraction of a second here; a loaded machine slows every process of the fleet many times over.
JOB_ENDS = 60.0


def config(procs: Cluster, redis: Proc, mock: Proc, **batch: Any) -> dict[str, Any]:
    return {
        "backends": [backend("a", mock)],
        "redis_url": redis.url,
        "console": {"enabled": True},
        "batch": {
            "storage_dir": str(procs.tmp / "batch"),
            "tick": TICK,
            "lease_ttl": LEASE,
            "per_engine": PER_ENGINE,
            **batch,
        },
    }


def live(router: Proc) -> dict[str, Any]:
    return dict(httpx.get(router.url + "/console/api/live", timeout=STARVED_S).json())


def submit(router: Proc, n: int) -> tuple[openai.OpenAI, str]:
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    f = c.files.create(
        file=("in.jsonl", jsonl([chat_line(i, max_tokens=2) for i in range(n)])), purpose="batch"
    )
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return c, job.id


def status(c: openai.OpenAI, job_id: str) -> str:
    return c.batches.retrieve(job_id).status


def completed(c: openai.OpenAI, job_id: str) -> int:
    counts = c.batches.retrieve(job_id).request_counts
    return 0 if counts is None else counts.completed


def rows(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).content.splitlines()]


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> Iterator[tuple[Cluster, Proc, Proc, Proc, Proc]]:
    redis = module_procs.redis()
    mock = module_procs.mock(ttft_ms=60, tokens=2)
    cfg = config(module_procs, redis, mock)
    yield module_procs, mock, module_procs.router(cfg), module_procs.router(cfg), redis


def test_two_replicas_share_one_jobs_lines(fleet: tuple[Cluster, Proc, Proc, Proc, Proc]) -> None:
    _, _, one, two, _ = fleet
    c, job_id = submit(one, 40)
    wait_for(lambda: status(c, job_id) == "completed", "the job completes", JOB_ENDS)
    done = c.batches.retrieve(job_id)
    assert done.request_counts.completed == 40
    ids = Counter(r["custom_id"] for r in rows(c, done.output_file_id))
    assert ids == Counter(f"req-{i}" for i in range(40))
    ran = [metric(p, "sluicegate_batch_lines_total", outcome="completed") for p in (one, two)]
    assert all(n > 0 for n in ran) and sum(ran) == 40, ran


def test_cancel_stops_new_lines_within_a_tick_and_keeps_what_finished(
    fleet: tuple[Cluster, Proc, Proc, Proc, Proc],
) -> None:
    _, _, one, _, _ = fleet
    c, job_id = submit(one, 60)
    wait_for(lambda: completed(c, job_id) >= 6, "some done", JOB_ENDS)
    # The console lists the running job with its progress.
    shown: dict[str, Any] = {}

    def listed() -> bool:
        shown.update(next((j for j in live(one)["batch"] if j["id"] == job_id), {}))
        return bool(shown)

    wait_for(listed, "on the console")
    assert shown["status"] == "in_progress" and shown["total"] == 60
    job = c.batches.cancel(job_id)
    assert job.status in ("cancelling", "cancelled")
    at_cancel = job.request_counts
    assert at_cancel is not None
    wait_for(lambda: status(c, job_id) == "cancelled", "the job is cancelled", JOB_ENDS)
    done = c.batches.retrieve(job_id)
    assert done.cancelled_at is not None and done.request_counts.total == 60
    # Only lines in flight at the cancel (per_engine on each of the two replicas) may end
    # after it: no replica starts one once the job is cancelling. Counted on this job's own
    # lines, so lines of another job still running on the fleet do not count.
    counts = done.request_counts
    assert counts is not None
    ended_after = counts.completed + counts.failed - at_cancel.completed - at_cancel.failed
    assert ended_after <= 2 * PER_ENGINE
    kept, marked = rows(c, done.output_file_id), rows(c, done.error_file_id)
    assert len(kept) == done.request_counts.completed < 60
    assert {r["error"]["code"] for r in marked} == {"batch_cancelled"}
    ids = Counter(r["custom_id"] for r in kept + marked)
    assert ids == Counter(f"req-{i}" for i in range(60))


def test_sigkilled_mid_job_the_restarted_router_completes_it_each_line_once(
    fleet: tuple[Cluster, Proc, Proc, Proc, Proc],
) -> None:
    procs, mock, first, other, redis = fleet
    other.stop()  # the killed router's lines must be taken again by the restarted one
    c, job_id = submit(first, 60)
    wait_for(lambda: completed(c, job_id) >= 12, "a fifth done", JOB_ENDS)
    first.kill9()
    second = procs.router(config(procs, redis, mock))
    c2 = openai.OpenAI(base_url=second.url + "/v1", api_key="none", max_retries=0)
    wait_for(lambda: status(c2, job_id) == "completed", "the job completes", JOB_ENDS)
    done = c2.batches.retrieve(job_id)
    assert done.request_counts.completed == 60 and done.request_counts.failed == 0
    ids = Counter(r["custom_id"] for r in rows(c2, done.output_file_id))
    assert ids == Counter(f"req-{i}" for i in range(60))
    assert rows(c2, done.error_file_id) == []
