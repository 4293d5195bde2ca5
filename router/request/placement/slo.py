"""A request's latency objectives: `x-slo-ttft-ms` and `x-slo-tpot-ms` (also under llm-d's names,
`x-llm-d-slo-ttft-ms` and `x-llm-d-slo-tpot-ms`), else its client key's `slo_ttft_ms` and
`slo_tpot_ms`. Read only for a balancer that declares `needs_tokens` (`latency`); a value that is
not a positive number of milliseconds (at most an hour) is refused 400, in the client's format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from router.core.errors import BadRequest

Slo = tuple[float | None, float | None]  # (ttft ms, tpot ms)
NO_SLO: Slo = (None, None)
MAX_MS = 3_600_000.0
_TTFT = (b"x-slo-ttft-ms", b"x-llm-d-slo-ttft-ms")
_TPOT = (b"x-slo-tpot-ms", b"x-llm-d-slo-tpot-ms")


def slo_of(headers: Sequence[tuple[bytes, bytes]], defaults: Slo, request_id: str) -> Slo:
    ttft, tpot = defaults
    for name, value in headers:
        low = name.lower()
        if low in _TTFT:
            ttft = _ms(low, value, request_id)
        elif low in _TPOT:
            tpot = _ms(low, value, request_id)
    return ttft, tpot


def _ms(name: bytes, value: bytes, request_id: str) -> float:
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_MS:  # NaN fails both
        header = name.decode("latin-1")
        raise BadRequest(
            f"Invalid header '{header}': expected a positive number of milliseconds.",
            code="invalid_slo",
            request_id=request_id,
            param=header,
        )
    return ms
