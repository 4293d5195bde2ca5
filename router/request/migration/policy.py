"""Migration policy: which calls may go on on another backend when their engine dies mid-answer,
and the streams each backend serves now, so that removing a backend moves them.

A call may migrate when `migration` (global, or the rule of its model) is on, it is a chat or
completion request, and nothing in it ties the answer to one engine's run: not `n > 1` (or
`best_of`), logprobs, `echo`, structured output (a grammar would start again mid-answer), a
prompt other than text; a tool call already streaming is checked when the stream breaks. With
`enabled` unset, `kind: openai` backends neither hand over nor take a continuation. A call that
may not migrate ends as before, and its error event says why.

Each outcome is counted in `sluicegate_migrations_total{model,result}` and logged:
    ok          a continuation streams on another backend (or a whole answer came from one)
    failed      no backend took the continuation
    limit       the stream broke again after `max_migrations`
    budget      the retry budget refused it
    refused     the call may not migrate (the log line says why)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.core.settings import MigrationConfig
from router.request.migration.relay import Relayed

log = logging.getLogger("sluicegate.migration")

SHAPES = ("chat", "completion")


@dataclass(frozen=True, slots=True)
class Plan:
    """A call that may migrate: how often, and which backends may not take it."""

    max_migrations: int
    shape: str
    skip_openai: bool  # `enabled` unset: openai backends take no continuation


class Migration:
    def __init__(
        self,
        cfg: MigrationConfig,
        count: Callable[[str, str], None] | None = None,
    ) -> None:
        self._cfg = cfg
        self._count = count or (lambda model, result: None)
        # Backend name -> the relays of streams running on it now (drain moves them).
        self.running: dict[str, set[Relayed]] = {}

    def plan(self, model: str, shape: str, payload: dict[str, Any]) -> Plan | str | None:
        """The call's plan; a reason (str) when migration is on but this call may not; None when
        it is off (or not a generation)."""
        if shape not in SHAPES:
            return None
        rule = self._cfg.models.get(model, self._cfg)
        if rule.enabled is False:
            return None
        why = refusal(payload, shape)
        if why is not None:
            return why
        return Plan(rule.max_migrations, shape, rule.enabled is None)

    def track(self, backend: str, relay: Relayed) -> None:
        self.running.setdefault(backend, set()).add(relay)

    def untrack(self, backend: str, relay: Relayed) -> None:
        streams = self.running.get(backend)
        if streams is not None:
            streams.discard(relay)
            if not streams:
                del self.running[backend]

    def backends_changed(self, names: set[str] | frozenset[str]) -> None:
        """The registry's backends are now `names`: streams on any other one move (its drain
        grace has ended: admin removal, discovery)."""
        for backend, streams in list(self.running.items()):
            if backend not in names:
                for relay in streams:
                    relay.move()

    def backends_removed(self, names: tuple[str, ...]) -> None:
        """`names` left the registry in a discovery change (their drain grace has ended): the
        streams on them move. Work in the size of the change, not of the fleet."""
        for backend in names:
            for relay in self.running.get(backend, ()):
                relay.move()

    def outcome(self, model: str, result: str, request_id: str, **fields: Any) -> None:
        self._count(model, result)
        log.info(
            "migration",
            extra={
                "fields": {"request_id": request_id, "model": model, "result": result, **fields}
            },
        )


def refusal(payload: dict[str, Any], shape: str) -> str | None:
    """Why this request's answer cannot be continued elsewhere, or None."""
    if shape == "completion" and not isinstance(payload.get("prompt"), str):
        return "its prompt is not a single text"
    if shape == "chat" and not isinstance(payload.get("messages"), list):
        return "it has no messages"
    if payload.keys().isdisjoint(_CHECKED):  # the common request: one set operation
        return None
    n = payload.get("n")
    if n is not None and n != 1:
        return "it asks for n > 1"
    best_of = payload.get("best_of")
    if best_of is not None and best_of != 1:
        return "it asks for best_of > 1"
    if payload.get("logprobs") not in (None, False) or payload.get("top_logprobs"):
        return "it asks for logprobs"
    if payload.get("prompt_logprobs") is not None:
        return "it asks for logprobs"
    if payload.get("echo"):
        return "it asks for echo"
    fmt = payload.get("response_format")
    structured = isinstance(fmt, dict) and fmt.get("type") not in (None, "text")
    if structured or any(payload.get(k) is not None for k in _STRUCTURED):
        return "it asks for structured output"
    return None


_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_CHECKED = frozenset(
    ("n", "best_of", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "response_format")
).union(_STRUCTURED)
