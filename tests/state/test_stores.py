"""The one table of stores (router/stores.py): each concern gets the process's own store without
Redis and the shared one with it, and every shared store but the registry's degrades by the one
rule (it is a `SharedStore`). Nothing here connects: a store opens its connections when used."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from router.core.redis_client import RedisConfig
from router.core.runner import Runner
from router.core.settings import Settings
from router.ops.metrics import Metrics
from router.registry.sync import RedisRecords
from router.state.store import SharedStore
from router.stores import STORES, Row, Wiring, build

PLAIN = Settings()
SHARED = Settings.model_validate({"redis_url": "redis://127.0.0.1:9/0"})  # never reached here


def _rows() -> dict[str, Row[Any]]:
    return {f.name: getattr(STORES, f.name) for f in dataclasses.fields(STORES)}


def test_each_concern_is_local_without_redis_and_shared_with_it() -> None:
    async def main() -> None:
        runner = Runner()
        metrics = Metrics()
        local = Wiring(PLAIN, metrics, runner)
        shared = Wiring(SHARED, metrics, runner, RedisConfig.from_settings(SHARED))
        rows = _rows()
        assert set(rows) == {
            "inflight",
            "quotas",
            "prefix_index",
            "registry",
            "usage",
            "response_ids",
            "demand",
        }
        for name, row in rows.items():
            own, common = build(row, local), build(row, shared)
            assert not isinstance(own, SharedStore), name
            if name == "registry":
                assert own.kind == "local" and isinstance(common, RedisRecords)
            else:
                assert isinstance(common, SharedStore), name
                assert common._runner is runner  # its heartbeat is a chore of the app's runner
            if own is not None:
                await own.aclose()
            await common.aclose()

    asyncio.run(main())
