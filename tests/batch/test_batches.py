"""The Batch API through the official `openai` SDK: one router with `batch:` on a real
redis-server, against a mock engine. A job's output holds each custom_id once with the engine's
exact answer; bad files are refused at create naming the line; limits hold."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import ValidationError

from router.core.settings import Settings
from tests.support.harness import (
    STARVED_S,
    Cluster,
    Proc,
    _cli,
    backend,
    booked,
    expected_text,
    metric,
    sha,
)
from tests.support.wait import wait_for

KEY = "sk-batch-one"
OTHER = "sk-batch-two"
LIMITED = "sk-batch-three"
COUNTED = "sk-batch-four"
ADMIN = "adm-batch"


def chat_line(i: int, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": url,
        "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], **body},
    }


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


@pytest.fixture(scope="module")
def redis(module_procs: Cluster) -> Proc:
    return module_procs.redis()


@pytest.fixture(scope="module")
def router(module_procs: Cluster, redis: Proc) -> Iterator[Proc]:
    mock = module_procs.mock(tokens=4)
    slow = module_procs.mock(name="slow", ttft_ms=8000, tokens=1)  # its lines stay in flight
    config = {
        "backends": [backend("a", mock), backend("b", slow, models={"s": "mock-model"})],
        "redis_url": redis.url,
        "api_keys": [
            {"sha256": sha(KEY), "name": "one"},
            {"sha256": sha(OTHER), "name": "two"},
            {"sha256": sha(LIMITED), "name": "three", "tpm": 1000},
            {"sha256": sha(COUNTED), "name": "four", "rpm": 2},
        ],
        "admin_token": ADMIN,
        "drain_grace": 0.5,  # the slow engine's line in flight does not hold the teardown
        "max_body_bytes": 4096,
        "batch": {
            "storage_dir": str(module_procs.tmp / "batch"),
            "max_file_bytes": 64 * 1024,
            "max_lines": 100,
            "max_jobs_per_key": 2,
            "tick": 0.05,
            "lease_ttl": 2,
        },
    }
    yield module_procs.router(config)


def client(router: Proc, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


def test_a_job_of_60_lines_completes_with_exact_output(router: Proc) -> None:
    c = client(router)
    f = c.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(60)])), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and c.files.retrieve(f.id).id == f.id
    job = c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "t1"},
    )
    assert job.status == "in_progress" and job.request_counts.total == 60
    assert job.metadata == {"run": "t1"}
    wait_for(
        lambda: c.batches.retrieve(job.id).status == "completed", "the job completes", STARVED_S
    )
    done = c.batches.retrieve(job.id)
    assert done.request_counts.completed == 60 and done.request_counts.failed == 0
    assert done.output_file_id is not None and done.error_file_id is None
    assert done.completed_at is not None
    rows = [json.loads(x) for x in c.files.content(done.output_file_id).content.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(60))
    for r in rows:
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["response"]["body"]["choices"][0]["message"]["content"] == expected_text(4)
    assert job.id in [b.id for b in c.batches.list(limit=10).data]
    # Another key sees neither the job nor its files.
    other = client(router, OTHER)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)
    assert metric(router, "sluicegate_batch_lines_total", outcome="completed") >= 60
    assert c.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


@pytest.mark.parametrize(
    ("lines", "line", "why"),
    [
        ([chat_line(0), b"{not json"], 2, "not valid JSON"),
        ([chat_line(0), chat_line(1), chat_line(0)], 3, "not unique"),
        ([chat_line(0), chat_line(1, url="/v1/moderations")], 2, "is not one of"),
        ([chat_line(0), chat_line(1, url="/v1/embeddings")], 2, "not the batch's endpoint"),
        ([chat_line(0, model="nope")], 1, "does not exist"),
        ([chat_line(0), chat_line(1, pad="x" * 5000)], 2, "longer than 4096 bytes"),
    ],
)
def test_an_invalid_file_is_refused_naming_its_line(
    router: Proc, lines: list[Any], line: int, why: str
) -> None:
    c = client(router)
    f = c.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as err:
        c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    message = err.value.body["message"]  # type: ignore[index]
    assert f"Line {line}" in message and why in message


def test_a_file_over_max_file_bytes_is_refused_while_it_streams(router: Proc) -> None:
    c = client(router)
    big = jsonl([chat_line(i, pad="y" * 3000) for i in range(30)])  # ~90 KB > 64 KB
    with pytest.raises(openai.APIStatusError) as err:
        c.files.create(file=("big.jsonl", big), purpose="batch")
    assert err.value.status_code == 413


def test_too_many_jobs_per_key(router: Proc) -> None:
    c = client(router, OTHER)
    line = chat_line(0, max_tokens=1)
    line["body"]["model"] = "s"  # served by an engine that answers after 8 s
    f = c.files.create(file=("in.jsonl", jsonl([line])), purpose="batch")
    jobs = [
        c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for _ in range(2)
    ]
    with pytest.raises(openai.RateLimitError) as err:
        c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert "max_jobs_per_key" in err.value.body["message"]  # type: ignore[index]
    assert all(c.batches.cancel(j.id).status in ("cancelling", "cancelled") for j in jobs)


def test_batch_tokens_never_push_the_keys_interactive_requests_into_429(router: Proc) -> None:
    c = client(router, LIMITED)
    f = c.files.create(
        file=("in.jsonl", jsonl([chat_line(i, max_tokens=2) for i in range(40)])), purpose="batch"
    )
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(
        lambda: c.batches.retrieve(job.id).status == "completed", "the job completes", STARVED_S
    )
    assert c.batches.retrieve(job.id).request_counts.completed == 40
    spent = booked(router, "three:batch", ADMIN)
    assert spent["requests"] == 40  # booked once per line, with the batch marker
    batch_tokens = spent["prompt_tokens"] + spent["completion_tokens"]
    # An interactive request whose estimate (its ~20 prompt tokens, by body bytes / 4, and
    # max_tokens) fits the key's tpm only if the batch's tokens are not in its window gets in.
    assert batch_tokens >= 100
    budget = 1000 - 40 - batch_tokens // 2
    answer = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=budget
    )
    assert answer.choices[0].message.content
    assert booked(router, "three", ADMIN)["requests"] == 1


def test_batch_without_redis_refuses_to_start_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as err:
        Settings.model_validate({"batch": {"storage_dir": str(tmp_path)}})
    assert "batch" in str(err.value) and "redis_url" in str(err.value)


def test_an_upload_that_is_no_form_or_not_purpose_batch_is_refused(router: Proc) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    r = httpx.post(router.url + "/v1/files", content=b"{}", headers=headers, timeout=5)
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    cut = b'--xx\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nabc'
    r = httpx.post(
        router.url + "/v1/files",
        content=cut,
        headers={**headers, "content-type": "multipart/form-data; boundary=xx"},
        timeout=5,
    )
    assert r.status_code == 400 and "closing boundary" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client(router).files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")


def test_the_batch_routes_count_against_the_keys_limits(router: Proc) -> None:
    c = client(router, COUNTED)
    c.batches.list()
    c.files.list()
    with pytest.raises(openai.RateLimitError):
        c.batches.list()
    with pytest.raises(openai.AuthenticationError):
        client(router, "sk-unknown").batches.list()


def test_an_expired_job_keeps_what_finished_and_marks_the_rest(router: Proc, redis: Proc) -> None:
    c = client(router)
    slow = chat_line(1, max_tokens=1)
    slow["body"]["model"] = "s"  # its engine answers after 8 s: the line is still running
    f = c.files.create(file=("in.jsonl", jsonl([{**slow, "custom_id": "late"}])), purpose="batch")
    job = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # Its 24 h window over: the job's expiry in Redis moved to the past.
    _cli(redis.port, "HSET", "{sluicegate:batch}:job:" + job.id, "expires_at", "1")
    wait_for(lambda: c.batches.retrieve(job.id).status == "expired", "the job expires")
    done = c.batches.retrieve(job.id)
    assert done.expired_at is not None and done.output_file_id is None
    (row,) = [json.loads(x) for x in c.files.content(done.error_file_id or "").content.splitlines()]
    assert row["custom_id"] == "late" and row["error"]["code"] == "batch_expired"
