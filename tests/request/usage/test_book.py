"""The in-memory usage book (no Redis): hourly buckets, 7 days kept, a cap that counts what it
drops; `since` as unix seconds or ISO-8601. Time is an injected clock."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from router.request.usage import book as usage_book
from router.request.usage.book import HOUR, UsageBook, parse_since
from router.request.usage.book_shared import SharedUsageBook
from tests.support.harness import free_port

T0 = 1_796_043_600.0  # 2026-11-30T13:00:00Z


def test_buckets_by_hour_and_filters() -> None:
    now = [T0 + 10]
    book = UsageBook(clock=lambda: now[0])
    book.record("a", "m", 10, 5, 4, False)
    book.record("a", "m", 1, 2, 0, True)
    now[0] = T0 + HOUR + 5
    book.record("b", "m", 7, 3, 0, False)
    rows = asyncio.run(book.query())
    assert [(r["key"], r["hour"], r["requests"]) for r in rows] == [
        ("a", "2026-11-30T13:00:00Z", 2),
        ("b", "2026-11-30T14:00:00Z", 1),
    ]
    first = rows[0]
    assert (first["prompt_tokens"], first["completion_tokens"], first["cached_tokens"]) == (
        11,
        7,
        4,
    )
    assert first["estimated_requests"] == 1
    assert [r["key"] for r in asyncio.run(book.query(since=T0 + HOUR))] == ["b"]
    assert [r["key"] for r in asyncio.run(book.query(key="a"))] == ["a"]
    assert asyncio.run(book.query(model="other")) == []


def test_seven_days_are_kept_and_the_cap_counts_what_it_drops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [T0]
    dropped: list[int] = []
    book = UsageBook(clock=lambda: now[0], on_dropped=dropped.append)
    book.record("a", "m", 1, 1, 0, False)
    now[0] = T0 + 7 * 24 * HOUR  # the first hour is now 7 days old: still kept
    book.record("a", "m", 1, 1, 0, False)
    assert len(asyncio.run(book.query(since=0))) == 2
    now[0] += HOUR
    book.record("a", "m", 1, 1, 0, False)
    assert [r["hour_unix"] for r in asyncio.run(book.query(since=0))] == [
        T0 + 7 * 24 * HOUR,
        T0 + 7 * 24 * HOUR + HOUR,
    ]
    monkeypatch.setattr(usage_book, "MAX_BUCKETS", 3)
    book.record("b", "m", 1, 1, 0, False)  # the third bucket
    book.record("c", "m", 1, 1, 0, False)  # over the cap
    book.record("a", "m", 1, 1, 0, False)  # an existing bucket still counts
    assert dropped == [1]
    assert {r["key"] for r in asyncio.run(book.query(since=0))} == {"a", "b"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1796043600", T0),
        ("1796043600.5", T0 + 0.5),
        ("2026-11-30T13:00:00Z", T0),
        ("2026-11-30T14:00:00+01:00", T0),
        ("2026-11-30T13:00:00", T0),  # naive: UTC
        ("2026-11-30", T0 - 13 * HOUR),
    ],
)
def test_since_forms(text: str, seconds: float) -> None:
    assert parse_since(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "nan", "inf", "-1", "1e12", "2026-02-30"])
def test_bad_since(text: str) -> None:
    with pytest.raises(ValueError):
        parse_since(text)


def test_counts_redis_will_not_take_at_shutdown_are_logged_as_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nothing listens on the port: the shutdown write fails at once.
    redis = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    book = SharedUsageBook(redis, clock=lambda: T0, timeout=1.0)
    book.record("alpha", "m", 10, 5, 0, False)
    book.record("beta", "m", 10, 5, 0, False)
    with caplog.at_level("WARNING", logger="sluicegate.usage"):
        asyncio.run(book.aclose())
    lost = [r for r in caplog.records if "at shutdown" in r.getMessage()]
    assert len(lost) == 1
    assert lost[0].fields["buckets"] == 2  # type: ignore[attr-defined]
