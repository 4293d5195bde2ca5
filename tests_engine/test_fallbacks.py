"""A real vLLM with a small `--max-model-len` falls back to real vLLMs with a larger one.

One engine of this module's own (`--max-model-len` SMALL_LEN, served as `tiny-llama-short`, a
few KV blocks) is two models to the router: `small`, whose prompts the router counts with the
model's own tokenizer (`affinity.tokenizers`, `via: router`), and `short`, which has no
tokenizer. `large` is the session's two engines (2,048 tokens). The router has
`context_window_fallbacks` from both to `large`, and reads the small engine's context from its
`/v1/models`. What the client sees, through the official openai SDK:
- a prompt over SMALL_LEN is answered by `large` without `small` being asked (the check before
  the call), streamed and not, with `x-sluicegate-model: large` and the large engine's body;
  one that fits exactly (its tokens plus `max_tokens` are SMALL_LEN) stays on `small`;
- the same prompt to `short` passes the check (a prompt no tokenizer counts is never guessed),
  gets the engine's own context-length 400, and falls back on it (vLLM 0.32 shortens a
  `max_tokens` that does not fit beside the prompt rather than refusing it: only a prompt over
  the context, or `max_tokens` over it alone, gets the 400);
- with `"fallbacks": []` in the body the client gets that 400 as vLLM gave it, in OpenAI's shape.

Whether `small` was asked is read from its own `http_requests_total` (vLLM's instrumentator).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.tools.enginefleet.fleet import START_TIMEOUT_S, Engine, EngineOptions, Fleet
from router.tools.enginefleet.install import engine_home, ensure_venv
from router.tools.enginefleet.model import write_model
from tests.support.harness import Cluster, Proc
from tests.support.wait import wait_for
from tests_engine.support import Words, router_metrics, start_router

SMALL_LEN = 256
# Two blocks of 128 tokens hold one SMALL_LEN sequence; twice that, so that a request never waits
# for another's blocks. No LoRA, NIXL or response store: it starts faster without them.
SMALL_OPTIONS = EngineOptions(model_name="tiny-llama-short", kv_blocks=4)
SDK_TIMEOUT_S = 120.0  # a loaded 2-core machine: several engines of other sessions beside these
MAX_TOKENS = 8
FELL_BACK = "sluicegate_fallbacks_total{reason=context_window}"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def small(engine_fleet: Fleet) -> Iterator[Engine]:
    """The short-context engine, started once for the module (about 25 s), in a process group of
    its own, stopped at the module's end whatever happened."""
    home = engine_home()
    keep = os.environ.get("SLUICEGATE_ENGINE_RUN_DIR")
    run_dir = Path(keep) / "fallbacks" if keep else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(
        ensure_venv(home),
        write_model(home / "models"),
        count=1,
        options=SMALL_OPTIONS,
        run_dir=run_dir,
        max_model_lens=[SMALL_LEN],
    )
    try:
        # Twice the fleet's own allowance: it starts beside the tier's engines (and, on a
        # shared machine, other sessions' ones).
        fleet.start(2 * START_TIMEOUT_S)
        yield fleet.engines[0]
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def router(engine_fleet: Fleet, small: Engine) -> Iterator[Proc]:
    """One router for the module, once it has read `small`'s context from its /v1/models."""
    cluster = Cluster()
    try:
        large = [
            {"name": f"large-{e.index}", "url": e.url, "kind": "vllm", "models": {"large": e.model}}
            for e in engine_fleet.engines
        ]
        # The same engine twice, as two models: one counted by its tokenizer, one not.
        smalls = [
            {"name": f"{name}-0", "url": small.url, "kind": "vllm", "models": {name: small.model}}
            for name in ("small", "short")
        ]
        proc = start_router(
            cluster,
            engine_fleet,
            {
                "backends": [*smalls, *large],
                "context_window_fallbacks": {"small": ["large"], "short": ["large"]},
                "affinity": {
                    "tokenizers": {"small": {"via": "router", "path": str(small.model_dir)}}
                },
                "lora": {"refresh": 0.5},  # /v1/models, where max_model_len comes from
            },
        )

        def context_known() -> bool:
            rows = httpx.get(proc.url + "/admin/backends", timeout=10).json()
            return all(
                (r.get("engine") or {}).get("max_model_len") == SMALL_LEN
                for r in rows
                if r["name"] in ("small-0", "short-0")
            )

        wait_for(context_known, "small's max_model_len read from its /v1/models", 60)
        yield proc
    finally:
        for p in cluster.procs:
            p.stop(grace=5)
        cluster.close()


def sdk(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=SDK_TIMEOUT_S
    )


def asked(engine: Engine, status: str) -> float:
    """Chat requests the engine answered with `status` (`2xx`, `4xx`), by its own count."""
    page = httpx.get(engine.metrics_url, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == "http_requests_total"
        and s.labels.get("handler") == CHAT
        and s.labels.get("status") == status
    )


def engine_tokens(engine: Engine, messages: list[dict[str, str]]) -> int:
    """The prompt's tokens as the engine counts them, chat template included (its /tokenize)."""
    r = httpx.post(
        engine.url + "/tokenize", json={"model": engine.model, "messages": messages}, timeout=30
    )
    r.raise_for_status()
    return int(r.json()["count"])


def create(
    router: Proc, messages: list[dict[str, str]], stream: bool, model: str = "small", **extra: Any
) -> Any:
    return sdk(router).chat.completions.with_raw_response.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=extra.pop("max_tokens", MAX_TOKENS),
        temperature=0,
        stream=stream,
        **extra,
    )


def served_text(raw: Any, stream: bool) -> tuple[str, set[str]]:
    """The answer's text and the `model` of its body (every chunk's, for a stream)."""
    if not stream:
        completion = raw.parse()
        return completion.choices[0].message.content or "", {completion.model}
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, {c.model for c in chunks}


def over(fleet: Fleet, seed: int) -> list[dict[str, str]]:
    """A chat prompt over SMALL_LEN by half of it, well within the large engines' context."""
    return [{"role": "user", "content": Words(fleet, seed=seed).text(3 * SMALL_LEN // 2)}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_prompt_over_the_small_context_is_served_by_the_large_model_before_the_call(
    fleet: Fleet, small: Engine, router: Proc, stream: bool
) -> None:
    messages = over(fleet, 48 + stream)
    assert SMALL_LEN < engine_tokens(small, messages) < fleet.options.max_model_len - MAX_TOKENS
    before = router_metrics(router).get(FELL_BACK, 0)
    refused, served = asked(small, "4xx"), asked(small, "2xx")
    raw = create(router, messages, stream)
    assert raw.headers["x-sluicegate-model"] == "large"
    assert raw.headers["x-sluicegate-backend"].startswith("large-")
    text, models = served_text(raw, stream)
    assert text and models == {fleet.engines[0].model}  # the large engines' own body
    assert (asked(small, "4xx"), asked(small, "2xx")) == (refused, served)  # never asked
    assert router_metrics(router).get(FELL_BACK, 0) == before + 1


def test_a_prompt_that_just_fits_stays_on_the_small_model(
    fleet: Fleet, small: Engine, router: Proc
) -> None:
    # The router counts what the engine counts (the chat template included): a prompt whose
    # tokens plus max_tokens are exactly the context is not sent away.
    messages = [{"role": "user", "content": Words(fleet, seed=47).text(SMALL_LEN - 40)}]
    max_tokens = SMALL_LEN - engine_tokens(small, messages)
    assert 0 < max_tokens < 40
    before = router_metrics(router).get(FELL_BACK, 0)
    raw = create(router, messages, False, max_tokens=max_tokens)
    assert raw.headers["x-sluicegate-model"] == "small"
    _, models = served_text(raw, False)
    assert models == {small.model}
    assert router_metrics(router).get(FELL_BACK, 0) == before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_small_engines_own_context_length_400_falls_back_too(
    fleet: Fleet, small: Engine, router: Proc, stream: bool
) -> None:
    # `short` has no tokenizer: the check before the call counts only max_tokens, lets the
    # prompt through, and the engine refuses it with its context-length 400.
    messages = over(fleet, 50 + stream)
    before = router_metrics(router).get(FELL_BACK, 0)
    refused = asked(small, "4xx")
    raw = create(router, messages, stream, model="short")
    assert raw.headers["x-sluicegate-model"] == "large"
    text, models = served_text(raw, stream)
    assert text and models == {fleet.engines[0].model}
    assert asked(small, "4xx") == refused + 1  # it was asked, and refused
    assert router_metrics(router).get(FELL_BACK, 0) == before + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_with_fallbacks_off_the_client_gets_vllms_400_in_openais_shape(
    fleet: Fleet, small: Engine, router: Proc, stream: bool
) -> None:
    messages = over(fleet, 52 + stream)
    before = router_metrics(router).get(FELL_BACK, 0)
    refused = asked(small, "4xx")
    with pytest.raises(openai.BadRequestError) as caught:
        create(router, messages, stream, extra_body={"fallbacks": []})
    error = caught.value
    assert error.status_code == 400
    assert error.response.headers["x-sluicegate-model"] == "small"
    body = error.response.json()
    assert set(body) == {"error"}, body  # OpenAI's shape, as vLLM wrote it
    assert f"maximum context length is {SMALL_LEN} tokens" in body["error"]["message"]
    assert asked(small, "4xx") == refused + 1
    assert router_metrics(router).get(FELL_BACK, 0) == before
