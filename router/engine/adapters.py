"""The LoRA adapters an engine serves, from its `GET /v1/models`: entries whose `parent` is one of
the backend's own model ids (vLLM lists each adapter, from `--lora-modules` or loaded at run time,
as `{"id": NAME, "root": PATH, "parent": BASE}`; base models have `"parent": null`).

Bounded like every engine answer: at most MAX_BODY bytes are read (by the caller) and MAX_ADAPTERS
names kept; a name that is not a plain id (visible ASCII, at most 256 characters) is dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping

from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.settings import LoraConfig

MAX_BODY = 1024 * 1024
MAX_ADAPTERS = 1024
_ID = re.compile(r"^[\x21-\x7e]{1,256}$")


class AdaptersError(ValueError):
    """The answer is not vLLM's model list."""


def adapters_of(body: bytes, bases: Collection[str]) -> frozenset[str]:
    """Adapter names listed in a `/v1/models` answer whose parent is in `bases`."""
    try:
        data = json.loads(body)["data"]
    except (ValueError, KeyError, TypeError):
        raise AdaptersError("not a model list") from None
    if not isinstance(data, list):
        raise AdaptersError("not a model list")
    out: set[str] = set()
    for entry in data:
        if not isinstance(entry, dict):
            continue
        name, parent = entry.get("id"), entry.get("parent")
        if isinstance(name, str) and parent in bases and name not in bases and _ID.match(name):
            out.add(name)
            if len(out) >= MAX_ADAPTERS:
                break
    return frozenset(out)


def max_model_len_of(body: bytes, bases: Collection[str]) -> int | None:
    """The shortest `max_model_len` a `/v1/models` answer gives its entries in `bases`."""
    try:
        data = json.loads(body)["data"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(data, list):
        return None
    lengths = [
        e["max_model_len"]
        for e in data
        if isinstance(e, dict)
        and e.get("id") in bases
        and isinstance(e.get("max_model_len"), int)
        and e["max_model_len"] > 0
    ]
    return min(lengths) if lengths else None


def base_models(entries: list[dict[str, object]]) -> list[dict[str, object]]:
    """`/v1/models` entries that are not adapters of another listed model (models: auto)."""
    ids = {e.get("id") for e in entries}
    return [e for e in entries if e.get("parent") is None or e.get("parent") not in ids]


def routes(
    backends: Iterable[Backend], readings: Mapping[str, EngineReading], cfg: LoraConfig
) -> dict[str, str | None]:
    """adapter -> the public base model it routes under (router/registry/fleet.py): each adapter
    an engine lists, under that backend's (first) model; with load on demand, each of
    `lora.sources`, under `lora.base_model` (None: any vLLM backend)."""
    out: dict[str, str | None] = (
        dict.fromkeys(cfg.sources, cfg.base_model) if cfg.load_on_demand else {}
    )
    for b in backends:
        r = readings.get(b.name)
        if r is None or not r.adapters or not b.models:
            continue
        base = min(b.models)
        for name in r.adapters:
            out.setdefault(name, base)
    return out
