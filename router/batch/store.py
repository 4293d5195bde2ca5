"""The Batch API's state in Redis: files' and jobs' records, the line queue and its leases.

Every key shares one hash tag (`{<redis_prefix>:batch}`), so each script runs on one slot.
- `file:<id>`: a file's record (JSON); `files:<owner>`: the owner's files by creation time.
- `job:<id>`: a job's hash (its record's fields, `status`, the `completed`/`failed` counts);
  `jobs:<owner>`: the owner's jobs by creation time; `open:<owner>`: its jobs not yet ended
  (`batch.max_jobs_per_key`); `active`: the jobs any replica may take lines of.
- `next:<id>`: the next line never handed out; `lease:<id>`: lines in flight -> when their
  lease ends (Redis's own clock, so replicas' clocks never disagree); `done:<id>`: line ->
  `1` (answered 2xx) or `0`.

Taking a line (`take`) first re-takes one whose lease ended (its replica died or stalled),
else hands out the next one. A line ends with `finish`: `HSETNX done` is the one claim of the
line, so a line that ran twice (its lease ended while it ran) is counted, charged and reported
once: the caller charges only when its claim won.
"""

from __future__ import annotations

import json
import time
from typing import Any

from router.core.redis_client import Client

_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
if redis.call('HGET', KEYS[3], 'status') ~= 'in_progress' then return -1 end
local late = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1)
if #late > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), late[1])
  return tonumber(late[1])
end
local n = tonumber(redis.call('GET', KEYS[2]) or '0')
if n >= tonumber(ARGV[2]) then return -1 end
redis.call('SET', KEYS[2], n + 1)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), n)
return n
"""

_RENEW = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[i]) end
return 0
"""

_FINISH = """
local st = redis.call('HGET', KEYS[3], 'status')
if st ~= 'in_progress' and st ~= 'cancelling' and st ~= 'finalizing' then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return -1
end
redis.call('ZREM', KEYS[2], ARGV[1])
if ARGV[2] == '1' then redis.call('HINCRBY', KEYS[3], 'completed', 1)
else redis.call('HINCRBY', KEYS[3], 'failed', 1) end
return redis.call('HLEN', KEYS[1])
"""

# A line in flight whose lease has not ended: the job cannot end before it does.
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""

_OPEN_JOB = """
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], unpack(cjson.decode(ARGV[4])))
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[2])
return 1
"""

# Only from a status that has not ended: two replicas ending a job end it once.
_END = """
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'completed' or st == 'failed' or st == 'cancelled' or st == 'expired' then return 0 end
redis.call('HSET', KEYS[1], unpack(cjson.decode(ARGV[1])))
redis.call('SREM', KEYS[2], ARGV[2])
redis.call('SREM', KEYS[3], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[4])
return 1
"""

_CANCEL = """
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'in_progress' and st ~= 'validating' then return st or '' end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
return 'cancelling'
"""

# An ended job's record is kept this long (s), then Redis lets it go: a key's thousands of
# small jobs never pile up (its files count against `batch.max_files_per_key`).
KEEP_ENDED = 30 * 24 * 3600
ENDED = frozenset({"completed", "failed", "cancelled", "expired"})
INT_FIELDS = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


class BatchStore:
    """The scripts and keys above over the app's Redis client (each call one round trip)."""

    def __init__(self, client: Client, prefix: str) -> None:
        self._r = client
        self._t = "{" + prefix + ":batch}:"
        self._scripts = {
            name: client.register_script(src)
            for name, src in (
                ("take", _TAKE),
                ("renew", _RENEW),
                ("finish", _FINISH),
                ("live", _LIVE),
                ("open", _OPEN_JOB),
                ("end", _END),
                ("cancel", _CANCEL),
            )
        }

    def _k(self, *parts: str) -> str:
        return self._t + ":".join(parts)

    # --- files ----------------------------------------------------------------------------

    async def put_file(self, record: dict[str, Any], owner: str) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self._k("file", record["id"]), json.dumps(record))
        pipe.zadd(self._k("files", owner), {record["id"]: record["created_at"]})
        await pipe.execute()

    async def file_count(self, owner: str) -> int:
        return int(await self._r.zcard(self._k("files", owner)))

    async def get_file(self, file_id: str) -> dict[str, Any] | None:
        raw = await self._r.get(self._k("file", file_id))
        return None if raw is None else dict(json.loads(raw))

    async def list_files(self, owner: str, limit: int) -> list[dict[str, Any]]:
        ids = await self._r.zrevrange(self._k("files", owner), 0, limit - 1)
        if not ids:
            return []
        raws = await self._r.mget([self._k("file", _s(i)) for i in ids])
        return [json.loads(r) for r in raws if r is not None]

    async def drop_file(self, file_id: str, owner: str) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.delete(self._k("file", file_id))
        pipe.zrem(self._k("files", owner), file_id)
        await pipe.execute()

    # --- jobs -----------------------------------------------------------------------------

    async def open_job(self, job: dict[str, str], owner: str, most: int) -> bool:
        """Record a new job unless the owner has `most` not yet ended; False then."""
        flat: list[str] = [x for kv in job.items() for x in kv]
        won = await self._scripts["open"](
            keys=[
                self._k("open", owner),
                self._k("job", job["id"]),
                self._k("jobs", owner),
                self._k("active"),
            ],
            args=[most, job["id"], job["created_at"], json.dumps(flat)],
        )
        return bool(won)

    async def job(self, job_id: str) -> dict[str, str] | None:
        raw = await self._r.hgetall(self._k("job", job_id))
        if not raw:
            return None
        return {_s(k): _s(v) for k, v in raw.items()}

    async def job_ids(self, owner: str, after: str | None, limit: int) -> list[str]:
        key = self._k("jobs", owner)
        start = 0
        if after is not None:
            rank: Any = await self._r.zrevrank(key, after)
            start = 0 if rank is None else int(rank) + 1
        return [_s(i) for i in await self._r.zrevrange(key, start, start + limit - 1)]

    async def active(self) -> list[str]:
        return sorted(_s(m) for m in await self._r.smembers(self._k("active")))

    async def cancel(self, job_id: str, now: int) -> str:
        return _s(await self._scripts["cancel"](keys=[self._k("job", job_id)], args=[now]))

    async def end(self, job_id: str, owner: str, fields: dict[str, str]) -> bool:
        flat = [x for kv in fields.items() for x in kv]
        now = int(time.time())
        won = await self._scripts["end"](
            keys=[
                self._k("job", job_id),
                self._k("open", owner),
                self._k("active"),
                self._k("jobs", owner),
            ],
            args=[json.dumps(flat), job_id, KEEP_ENDED, now - KEEP_ENDED],
        )
        if won:
            pipe = self._r.pipeline(transaction=False)
            for name in ("next", "lease", "done"):
                pipe.delete(self._k(name, job_id))
            await pipe.execute()
        return bool(won)

    async def set_fields(self, job_id: str, fields: dict[str, str]) -> None:
        await self._r.hset(self._k("job", job_id), mapping=fields)  # type: ignore[arg-type]

    # --- lines ----------------------------------------------------------------------------

    async def take(self, job_id: str, total: int, lease_ttl: float) -> int:
        """A line to run (its index), or -1: none left to hand out, or the job is not running."""
        got = await self._scripts["take"](
            keys=[self._k("lease", job_id), self._k("next", job_id), self._k("job", job_id)],
            args=[lease_ttl, total],
        )
        return int(got)

    async def renew(self, job_id: str, lines: list[int], lease_ttl: float) -> None:
        if lines:
            await self._scripts["renew"](keys=[self._k("lease", job_id)], args=[lease_ttl, *lines])

    async def finish(self, job_id: str, line: int, ok: bool) -> int:
        """Claim the line's one result: the lines ended so far, or -1 when another run had."""
        got = await self._scripts["finish"](
            keys=[self._k("done", job_id), self._k("lease", job_id), self._k("job", job_id)],
            args=[line, "1" if ok else "0"],
        )
        return int(got)

    async def release(self, job_id: str, line: int) -> None:
        """Hand a line back unfinished (its run was stopped): any replica takes it again."""
        await self._r.zadd(self._k("lease", job_id), {str(line): 0}, xx=True)

    async def live(self, job_id: str) -> int:
        return int(await self._scripts["live"](keys=[self._k("lease", job_id)]))

    async def ended_lines(self, job_id: str) -> int:
        return int(await self._r.hlen(self._k("done", job_id)))

    async def lock(self, job_id: str, owner: str, seconds: int) -> bool:
        """One replica at a time writes a job's results."""
        return bool(await self._r.set(self._k("final", job_id), owner, nx=True, ex=seconds))


def _s(value: Any) -> str:
    """A reply of the client (bytes: it does not decode) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
