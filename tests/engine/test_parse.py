"""Engine readings are bounded however hostile the page (router/engine/parse.py)."""

from __future__ import annotations

import pytest

from router.engine.parse import MAX_SERIES, MetricsError, parse


def test_capacity_is_capped_and_implausible_reports_ignored() -> None:
    base = b"vllm:num_requests_running 1\n"

    def capacity(labels: str, cap: int = 8 * 1024 * 1024) -> int | None:
        line = f"vllm:cache_config_info{{{labels}}} 1.0\n".encode()
        return parse(base + line, "vllm", cap).kv_capacity_tokens

    assert capacity('block_size="16",num_gpu_blocks="4096"') == 65536
    assert capacity('block_size="16",num_gpu_blocks="100000000"') == 8 * 1024 * 1024
    assert capacity('block_size="16",num_gpu_blocks="1000000000000"') is None  # no GPU's
    assert capacity('block_size="16",num_gpu_blocks="4096"', cap=1000) == 1000
    assert capacity('block_size="1000000",num_gpu_blocks="1000"') is None
    assert capacity('block_size="1e6",num_gpu_blocks="1e12"') is None
    assert capacity('block_size="16",num_gpu_blocks="None"') is None  # before the profile run


def test_series_per_family_are_capped() -> None:
    ok = b"".join(b'vllm:num_requests_running{engine="%d"} 1\n' % i for i in range(MAX_SERIES))
    assert parse(ok, "vllm").running == MAX_SERIES
    with pytest.raises(MetricsError, match="too many series"):
        parse(ok + b'vllm:num_requests_running{engine="x"} 1\n', "vllm")
    # Lines that only start with a wanted name cost a loop turn each: bounded as well.
    longer = b"".join(b"vllm:num_requests_running_x%d 1\n" % i for i in range(5000))
    with pytest.raises(MetricsError, match="too many series"):
        parse(longer + b"vllm:num_requests_running 1\n", "vllm")
