"""vLLM's queue in prompt tokens, read when an engine exports it: the uncached count first."""

from __future__ import annotations

from router.engine.parse import parse

BASE = b'vllm:num_requests_waiting{model_name="m"} 2\nvllm:num_requests_running{model_name="m"} 3\n'


def test_the_uncached_waiting_tokens_win_over_the_whole_count() -> None:
    assert parse(BASE, "vllm").tokens_waiting is None
    whole = BASE + b'vllm:num_tokens_waiting{model_name="m",engine="0"} 700\n'
    whole += b'vllm:num_tokens_waiting{model_name="m",engine="1"} 300\n'
    assert parse(whole, "vllm").tokens_waiting == 1000.0  # summed over ranks
    both = whole + b'vllm:approximate_uncached_tokens_waiting{model_name="m"} 250\n'
    assert parse(both, "vllm").tokens_waiting == 250.0
