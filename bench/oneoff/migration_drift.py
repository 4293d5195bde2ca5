"""How often a continuation from re-tokenized text differs from the uninterrupted answer, beside
one from token ids, on one real vLLM engine at temperature 0
(`python -m bench.oneoff.migration_drift`).

For each prompt: the uninterrupted answer (MAX_TOKENS, `ignore_eos`, `return_token_ids`), then,
for each cut point k, two continuations of its first k tokens:
- text: the prompt plus the text of those k tokens (what sluicegate's migration sends; chat: an
  assistant message with `continue_final_message`);
- ids: the prompt's token ids plus the k generated ids, as a token-id prompt on /v1/completions.
A continuation matches when the stitched answer (first k tokens' text + continuation) equals the
uninterrupted one. Prints one JSON line; about a minute with the engine's start.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from router.tools.enginefleet.fleet import EngineOptions, Fleet
from router.tools.enginefleet.install import engine_home, ensure_venv
from router.tools.enginefleet.model import write_model

MAX_TOKENS = 64
CUTS = (1, 5, 13, 24, 40)
PROMPTS = [
    "The router streams every token the engine generates, in order",
    "Once upon a time, a gateway between applications and models",
    "def migrate(stream, backend):\n    ",
    "Zürich, Kraków and Tōkyō each run a fleet of engines that",
    "A long answer, token after token, from an engine that may die:",
    "Prefill, decode, and the KV cache: three words every platform team",
]


def _complete(
    url: str, model: str, prompt: Any, max_tokens: int
) -> tuple[str, list[int], list[int]]:
    """(text deltas joined, generated ids, prompt ids) of a streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    return _stream(url + "/v1/completions", body, "text")


def _stream(url: str, body: dict[str, Any], key: str) -> tuple[str, list[int], list[int]]:
    text: list[str] = []
    ids: list[int] = []
    prompt_ids: list[int] = []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("prompt_token_ids"):
                prompt_ids = event["prompt_token_ids"]
            for choice in event.get("choices", []):
                part = choice.get("delta", {}).get("content") if key == "content" else choice[key]
                text.append(part or "")
                ids += choice.get("token_ids") or []
                prompt_ids = choice.get("prompt_token_ids") or prompt_ids
    return "".join(text), ids, prompt_ids


def _chat(
    url: str, model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
) -> str:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    return _stream(url + "/v1/chat/completions", body, "content")[0]


def main() -> None:
    home = engine_home()
    fleet = Fleet(ensure_venv(home), write_model(home / "models"), 1, EngineOptions())
    fleet.start()
    try:
        engine = fleet.engines[0]
        url, model = engine.url, engine.model
        tok = httpx.Client(base_url=url, timeout=30)
        counts = {"text": 0, "ids": 0, "chat_text": 0, "retokenized_differs": 0, "cases": 0}
        for prompt in PROMPTS:
            whole, ids, prompt_ids = _complete(url, model, prompt, MAX_TOKENS)
            messages = [{"role": "user", "content": prompt}]
            chat_whole = _chat(url, model, messages, MAX_TOKENS)
            for k in CUTS:
                counts["cases"] += 1
                head = tok.post("/detokenize", json={"model": model, "tokens": ids[:k]}).json()
                head_text = head["prompt"]
                again = tok.post("/tokenize", json={"model": model, "prompt": prompt + head_text})
                if again.json()["tokens"] != prompt_ids + ids[:k]:
                    counts["retokenized_differs"] += 1
                text = _complete(url, model, prompt + head_text, MAX_TOKENS - k)[0]
                counts["text"] += head_text + text == whole
                by_ids = _complete(url, model, prompt_ids + ids[:k], MAX_TOKENS - k)[0]
                counts["ids"] += head_text + by_ids == whole
                chat_head = _chat(url, model, messages, k)
                chat_rest = _chat(
                    url,
                    model,
                    [*messages, {"role": "assistant", "content": chat_head}],
                    MAX_TOKENS - k,
                    continue_final_message=True,
                    add_generation_prompt=False,
                )
                counts["chat_text"] += chat_head + chat_rest == chat_whole
        n = counts["cases"]
        print(
            json.dumps(
                {
                    "cases": n,
                    "text_matches": counts["text"] / n,
                    "ids_matches": counts["ids"] / n,
                    "chat_text_matches": counts["chat_text"] / n,
                    "retokenized_prompt_differs": counts["retokenized_differs"] / n,
                    "max_tokens": MAX_TOKENS,
                    "cuts": CUTS,
                }
            ),
            flush=True,
        )
    finally:
        fleet.stop()


if __name__ == "__main__":
    main()
