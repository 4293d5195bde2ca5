"""`x-session-token` and the agents' session headers: the token names its backend only to the key's
holder, reads back among the candidates, refuses what is not one; the default session headers
are the coding agents' own; SLO headers parse or are refused."""

from __future__ import annotations

import pytest

from router.core.errors import BadRequest
from router.core.settings import AffinityConfig
from router.request.placement.session_token import MAX_TOKEN_CHARS, SessionTokens
from router.request.placement.slo import slo_of


def test_a_token_names_its_backend_opaquely_and_reads_back() -> None:
    tokens = SessionTokens(b"k1")
    name = "gpu-a.internal:8000"
    token = tokens.token(name)
    assert b"gpu" not in token and b"8000" not in token and len(token) == 22
    assert tokens.token(name) == token  # stable
    # Another process with the same key reads it; one with another key does not.
    assert SessionTokens(b"k1").backend(token, ["x", name]) == name
    assert SessionTokens(b"k2").backend(token, ["x", name]) is None
    assert SessionTokens().backend(token, [name]) is None  # a random key of its own
    assert tokens.backend(b"", [name]) is None
    assert tokens.backend(b"a" * (MAX_TOKEN_CHARS + 1), [name]) is None


def test_the_default_session_headers_are_the_agents() -> None:
    assert AffinityConfig().session_headers == [
        "x-claude-code-session-id",
        "session-id",
        "x-session-affinity",
        "x-session-id",
    ]


def test_slo_headers_under_both_names_over_the_key_defaults() -> None:
    assert slo_of([], (100.0, None), "r") == (100.0, None)
    assert slo_of([(b"X-SLO-TTFT-MS", b"250")], (100.0, 20.0), "r") == (250.0, 20.0)
    assert slo_of([(b"x-llm-d-slo-tpot-ms", b"15.5")], (None, None), "r") == (None, 15.5)
    for bad in (b"0", b"-3", b"nan", b"inf", b"soon", b"99999999"):
        with pytest.raises(BadRequest) as refused:
            slo_of([(b"x-slo-ttft-ms", bad)], (None, None), "r")
        assert refused.value.code == "invalid_slo" and refused.value.param == "x-slo-ttft-ms"
