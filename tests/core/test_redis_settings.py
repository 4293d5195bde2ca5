"""Which Redis: the settings that name one (a URL, Sentinel, Cluster) are checked at startup with
one line naming the field and never the password, and become the right kind of client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.asyncio import RedisCluster
from redis.asyncio.connection import UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from router.core.redis_client import RedisTarget
from router.core.settings import ConfigError, load_settings


def settings_from(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_settings(path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("redis_url: http://:hunter22@r:6379\n", "redis_url"),
        ("redis_sentinels: ['s1:26379']\n", "redis_sentinel_master"),
        ("redis_sentinel_master: mymaster\n", "redis_sentinel_master"),
        ("redis_sentinels: ['s1']\nredis_sentinel_master: m\n", "redis_sentinels"),
        ("redis_sentinels: ['s1:99999']\nredis_sentinel_master: m\n", "redis_sentinels"),
        (
            "redis_url: unix:///run/r.sock\nredis_sentinels: ['s1:26379']\n"
            "redis_sentinel_master: m\n",
            "redis_sentinels",
        ),
        ("redis_cluster: true\n", "redis_cluster"),
        ("redis_cluster: true\nredis_url: unix:///run/redis.sock\n", "redis_cluster"),
        (
            "redis_cluster: true\nredis_url: redis://r:6379\n"
            "redis_sentinels: ['s1:26379']\nredis_sentinel_master: m\n",
            "redis_cluster",
        ),
    ],
)
def test_impossible_redis_settings_stop_startup(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from(tmp_path, text)
    message = str(info.value)
    assert field in message and "hunter22" not in message, message
    assert "\n" not in message


def test_each_shape_becomes_its_client(tmp_path: Path) -> None:
    asyncio.run(each_shape(tmp_path))


async def each_shape(tmp_path: Path) -> None:
    assert RedisTarget.from_settings(settings_from(tmp_path, "{}\n")) is None

    unix = RedisTarget.from_settings(settings_from(tmp_path, "redis_url: unix:///run/r.sock\n"))
    assert unix is not None and unix.kind == "standalone"
    client = unix.client(timeout=0.1, max_connections=2)
    assert client.connection_pool.connection_class is UnixDomainSocketConnection
    await client.aclose()

    cluster = RedisTarget.from_settings(
        settings_from(tmp_path, "redis_url: rediss://r:6379\nredis_cluster: true\n")
    )
    assert cluster is not None and cluster.kind == "cluster"
    cc = cluster.client(timeout=0.1, max_connections=2)
    assert isinstance(cc, RedisCluster)
    await cc.aclose()

    sentinel = RedisTarget.from_settings(
        settings_from(
            tmp_path,
            "redis_url: rediss://:pw@ignored:1/3\nredis_sentinel_master: llm\n"
            "redis_sentinels: ['10.0.0.1:26379', 'sentinel-b:26380']\n"
            "redis_sentinel_password: sentinel-pw\n",
        )
    )
    assert sentinel is not None and sentinel.kind == "sentinel"
    sc = sentinel.client(timeout=0.1, max_connections=2)
    pool = sc.connection_pool
    # TLS, password and db from the URL reach the master; its host does not.
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "llm"
    assert pool.connection_class is SentinelManagedSSLConnection
    assert pool.connection_kwargs["password"] == "pw" and pool.connection_kwargs["db"] == 3
    assert "host" not in pool.connection_kwargs
    sentinels = pool.sentinel_manager.sentinels
    addrs = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in sentinels
    ]
    assert addrs == [("10.0.0.1", 26379), ("sentinel-b", 26380)]
    assert all(s.connection_pool.connection_kwargs["password"] == "sentinel-pw" for s in sentinels)
    await sc.aclose()
