"""Per-backend health as seen by this process, and the filter the proxy routes through.

Three writers, each with its own flag, like Envoy's FAILED_ACTIVE_HC / FAILED_OUTLIER_CHECK:
active probes (`on_probe`: flips after `unhealthy_threshold` / `healthy_threshold` results in a
row), passive outlier detection (`on_failure` / `on_success` from real traffic: ejection with
backoff, never more than `max_ejection_percent` of a model's backends), and cooldowns
(`cool_down`, from a 429/503 Retry-After). A backend is routable when no flag is set and it is not
draining; when none of a model's backends is, `eligible` returns all of them (panic mode) but
those cooling down.
Reading (`routable`, `eligible`, `retry_after`, `describe`) never changes state: a flag whose
time is up simply stops counting. The transitions that time brings (an ejection or a cooldown
ending, panic mode starting or ending) are applied by `advance()`, which the monitor calls every
tick, and by any write about that backend. Time comes from an injected clock; every transition is
logged once on `sluicegate.health`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from health import outlier
from router.core.backend import Backend
from router.core.errors import FailureKind
from router.core.settings import HealthConfig, OutlierConfig

log = logging.getLogger("sluicegate.health")


@dataclass(slots=True)
class ProbeResult:
    ok: bool
    latency_ms: float | None = None
    reason: str | None = None  # why it failed: "connect", "timeout", "status_503", ...


@dataclass(slots=True)
class BackendHealth:
    # Active probes.
    probe_failed: bool = False
    probe_successes: int = 0  # in a row
    probe_failures: int = 0  # in a row
    probe_reason: str | None = None
    last_probe_latency_ms: float | None = None
    # Passive outlier detection.
    consecutive_failures: int = 0
    last_error: str | None = None
    ejected_until: float = 0.0  # 0: not ejected
    times_ejected: int = 0
    last_ejection_end: float | None = None
    eject_reason: str | None = None
    probe_failed_while_ejected: bool = False
    # The last ejection was ended by probes alone; if it is ejected again soon after, probes
    # alone no longer end it (a /health that answers while completions fail).
    readmitted_by_probe: bool = False
    # Cooldown asked for by the backend (Retry-After).
    cooldown_until: float = 0.0


def merged(default: Any, override: Any) -> Any:
    """A per-backend section over the global one: only the keys the backend set win."""
    if override is None:
        return default
    return default.model_copy(update=override.model_dump(exclude_unset=True))


class HealthBook:
    def __init__(
        self,
        health: HealthConfig | None = None,
        outlier_cfg: OutlierConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_change: Callable[[str, bool, str], None] | None = None,
    ) -> None:
        self._on_change = on_change  # (backend, routable, reason): e.g. the metrics
        # Told when traffic ejects a backend (the probe scheduler moves its next probe forward).
        self.on_ejected: Callable[[str], None] | None = None
        self._health = health or HealthConfig()
        self._outlier = outlier_cfg or OutlierConfig()
        self._clock = clock
        self._wall = wall
        self._state: dict[str, BackendHealth] = {}
        self._health_cfg: dict[str, HealthConfig] = {}
        self._outlier_cfg: dict[str, OutlierConfig] = {}
        self._groups: dict[str, tuple[str, ...]] = {}  # model -> backend names
        self._models_of: dict[str, tuple[str, ...]] = {}  # backend name -> models
        self._urls: dict[str, str] = {}
        self._panicking: set[str] = set()
        self._draining: set[str] = set()
        self._members: dict[str, dict[str, None]] = {}  # model -> names, in order (`update`)

    # -- the backend set --------------------------------------------------------------------

    def sync(self, backends: Sequence[Backend]) -> None:
        """Adopt a new backend set: per-backend settings, model groups; forget removed ones."""
        names = {b.name for b in backends}
        for b in backends:
            if self._urls.get(b.name, b.url) != b.url:
                self._state.pop(b.name, None)  # another server under the same name
        self._urls = {b.name: b.url for b in backends}
        self._health_cfg = {b.name: merged(self._health, b.health) for b in backends}
        self._outlier_cfg = {b.name: merged(self._outlier, b.outlier) for b in backends}
        groups: dict[str, list[str]] = {}
        for b in backends:
            for model in b.models:
                groups.setdefault(model, []).append(b.name)
        self._groups = {m: tuple(ns) for m, ns in groups.items()}
        self._members = {m: dict.fromkeys(ns) for m, ns in groups.items()}
        self._models_of = {b.name: tuple(b.models) for b in backends}
        self._draining = {b.name for b in backends if b.draining}
        for gone in set(self._state) - names:
            del self._state[gone]
        self._panicking &= set(self._groups)

    def update(self, upserted: Sequence[Backend], removed: Sequence[str]) -> None:
        """`sync` for a change alone (a discovery slice): work in the size of the change."""
        touched: set[str] = set()
        for name in removed:
            self._urls.pop(name, None)
            self._health_cfg.pop(name, None)
            self._outlier_cfg.pop(name, None)
            self._state.pop(name, None)
            self._draining.discard(name)
            for m in self._models_of.pop(name, ()):
                touched.add(m)
                self._members.get(m, {}).pop(name, None)
        # Discovered backends share their template's sections: merged once per section.
        health_of: dict[int, HealthConfig] = {}
        outlier_of: dict[int, OutlierConfig] = {}
        for b in upserted:
            if self._urls.get(b.name, b.url) != b.url:
                self._state.pop(b.name, None)  # another server under the same name
            self._urls[b.name] = b.url
            h = health_of.get(id(b.health))
            if h is None:
                h = health_of[id(b.health)] = merged(self._health, b.health)
            o = outlier_of.get(id(b.outlier))
            if o is None:
                o = outlier_of[id(b.outlier)] = merged(self._outlier, b.outlier)
            self._health_cfg[b.name] = h
            self._outlier_cfg[b.name] = o
            for m in self._models_of.get(b.name, ()):
                if m not in b.models:
                    touched.add(m)
                    self._members.get(m, {}).pop(b.name, None)
            self._models_of[b.name] = tuple(b.models)
            for m in b.models:
                touched.add(m)
                self._members.setdefault(m, {})[b.name] = None
            if b.draining:
                self._draining.add(b.name)
            else:
                self._draining.discard(b.name)
        for m in touched:
            members = self._members.get(m)
            if members:
                self._groups[m] = tuple(members)
            else:
                self._groups.pop(m, None)
                self._members.pop(m, None)
                self._panicking.discard(m)

    def health_config(self, name: str) -> HealthConfig:
        return self._health_cfg.get(name, self._health)

    def outlier_config(self, name: str) -> OutlierConfig:
        return self._outlier_cfg.get(name, self._outlier)

    def _get(self, name: str) -> BackendHealth:
        st = self._state.get(name)
        if st is None:
            st = self._state[name] = BackendHealth()
        return st

    # -- routing ----------------------------------------------------------------------------

    def routable(self, backend: Backend, now: float) -> bool:
        if backend.draining:
            return False
        st = self._state.get(backend.name)
        if st is None:
            return True
        return not (st.probe_failed or st.ejected_until > now or st.cooldown_until > now)

    def eligible(self, backends: Sequence[Backend], model: str = "") -> list[Backend]:
        now = self._clock()
        ok = [b for b in backends if self.routable(b, now)]
        if ok:
            return ok
        # Panic mode: when nothing looks healthy, try them all rather than fail everything;
        # except those that asked for a pause (Retry-After): they are left alone as asked.
        return [b for b in backends if not b.draining and not self._cooling(b.name, now)]

    def healthy(self, backends: Sequence[Backend]) -> list[Backend]:
        """The routable ones, no panic mode: for a leg that has another way to be served (a
        prefill engine: the decode engine can serve the request whole)."""
        now = self._clock()
        return [b for b in backends if self.routable(b, now)]

    def advance(self) -> None:
        """Apply what time has brought: ejections and cooldowns that ended, panic mode entered or
        left by a model. Called by the monitor's tick; reads never do this."""
        now = self._clock()
        for name, st in list(self._state.items()):
            if st.ejected_until or st.cooldown_until:  # nothing else ends with time
                self._settle(name, st, now)
        for model, names in self._groups.items():
            # Stops at the first routable backend: a large healthy fleet costs little per tick.
            if not any(self._free(n, now) for n in names):
                healthy = 0
            elif model in self._panicking:
                healthy = sum(1 for n in names if self._free(n, now))
            else:
                continue
            if healthy and model in self._panicking:
                self._panicking.discard(model)
                self._transition("panic mode over", None, model=model, healthy=healthy)
            elif not healthy and names and model not in self._panicking:
                self._panicking.add(model)
                self._transition("panic mode", None, model=model, backends=len(names))

    def panicking(self) -> frozenset[str]:
        """The models in panic mode as of the last `advance()`."""
        return frozenset(self._panicking)

    def _free(self, name: str, now: float) -> bool:
        if name in self._draining:
            return False
        st = self._state.get(name)
        return st is None or not (
            st.probe_failed or st.ejected_until > now or st.cooldown_until > now
        )

    def _settle(self, name: str, st: BackendHealth, now: float) -> None:
        if st.ejected_until and st.ejected_until <= now:
            # It ended when its time was up, however late this tick noticed.
            self._end_ejection(name, st, st.ejected_until, "expired")
        if st.cooldown_until and st.cooldown_until <= now:
            st.cooldown_until = 0.0
            self._transition("cooldown over", name)

    def _cooling(self, name: str, now: float) -> bool:
        st = self._state.get(name)
        return st is not None and st.cooldown_until > now

    def retry_after(self, backends: Sequence[Backend]) -> float | None:
        """Seconds until the first of `backends` ends its cooldown, if any is cooling."""
        now = self._clock()
        waits = [
            st.cooldown_until - now
            for b in backends
            if (st := self._state.get(b.name)) is not None and st.cooldown_until > now
        ]
        return min(waits) if waits else None

    # -- passive detection ------------------------------------------------------------------

    def on_success(self, name: str) -> None:
        st = self._state.get(name)
        if st is not None and st.consecutive_failures:
            st.consecutive_failures = 0

    def on_failure(self, name: str, kind: FailureKind, status: int | None = None) -> None:
        """A real request to `name` failed (`status`: the answer's, for `FailureKind.STATUS`)."""
        if not outlier.counts_as_failure(kind, status):
            return
        reason = f"status_{status}" if kind is FailureKind.STATUS else str(kind)
        st = self._get(name)
        now = self._clock()
        self._settle(name, st, now)
        st.consecutive_failures += 1
        st.last_error = reason
        if st.ejected_until > now:
            return  # requests that were already in flight when it was ejected
        cfg = self.outlier_config(name)
        if outlier.should_eject(cfg, st.consecutive_failures):
            self._eject(name, st, cfg, now, reason)

    def _eject(
        self, name: str, st: BackendHealth, cfg: OutlierConfig, now: float, kind: str
    ) -> None:
        for model in self._models_of.get(name, ()):
            group = self._groups.get(model, ())
            ejected = sum(
                1
                for other in group
                if other != name
                and (o := self._state.get(other)) is not None
                and o.ejected_until > now
            )
            if not outlier.within_share(cfg, ejected, len(group)):
                if st.consecutive_failures == cfg.consecutive_failures:  # log the first refusal
                    self._transition(
                        "ejection refused",
                        name,
                        reason=kind,
                        model=model,
                        ejected=ejected,
                        backends=len(group),
                        max_ejection_percent=cfg.max_ejection_percent,
                    )
                return
        times = outlier.times_ejected_after_rest(cfg, st.times_ejected, st.last_ejection_end, now)
        if times == 0:
            st.readmitted_by_probe = False  # a quiet max_ejection since: trust probes again
        st.probe_successes = 0  # readmission counts good probes from now on
        st.times_ejected = times + 1
        seconds = outlier.ejection_seconds(cfg, st.times_ejected)
        st.ejected_until = now + seconds
        st.eject_reason = f"{st.consecutive_failures} consecutive failures ({kind})"
        st.probe_failed_while_ejected = False
        self._transition(
            "ejected",
            name,
            reason=kind,
            consecutive_failures=st.consecutive_failures,
            times_ejected=st.times_ejected,
            seconds=seconds,
        )
        if self.on_ejected is not None:
            self.on_ejected(name)

    def _end_ejection(self, name: str, st: BackendHealth, now: float, why: str) -> None:
        st.ejected_until = 0.0
        st.last_ejection_end = now
        st.consecutive_failures = 0
        st.eject_reason = None
        st.probe_failed_while_ejected = False
        self._transition("ejection over", name, why=why, times_ejected=st.times_ejected)

    # -- cooldowns --------------------------------------------------------------------------

    def cool_down(self, name: str, seconds: float) -> None:
        st = self._get(name)
        now = self._clock()
        self._settle(name, st, now)
        until = now + seconds
        if until <= st.cooldown_until:
            return
        fresh = st.cooldown_until <= now
        st.cooldown_until = until
        if fresh:
            self._transition("cooling down", name, seconds=seconds)

    # -- active probes ----------------------------------------------------------------------

    def on_probe(self, name: str, result: ProbeResult) -> None:
        st = self._get(name)
        cfg = self.health_config(name)
        now = self._clock()
        self._settle(name, st, now)
        if result.latency_ms is not None:
            st.last_probe_latency_ms = result.latency_ms
        ejected = st.ejected_until > now
        if not result.ok:
            st.probe_successes = 0
            st.probe_failures += 1
            st.probe_reason = result.reason
            if ejected:
                st.probe_failed_while_ejected = True
            if not st.probe_failed and st.probe_failures >= cfg.unhealthy_threshold:
                st.probe_failed = True
                self._transition(
                    "unhealthy", name, reason=result.reason, probe_failures=st.probe_failures
                )
            return
        st.probe_failures = 0
        st.probe_successes += 1
        if st.probe_successes < cfg.healthy_threshold:
            return
        if st.probe_failed:
            st.probe_failed = False
            st.probe_reason = None
            self._transition("healthy", name, probe_successes=st.probe_successes)
        # Good probes end an ejection early (Envoy's successful_active_health_check_uneject_host):
        # a restarted backend is back within seconds. If it fails again right after such a
        # readmission (a /health that answers while completions fail), its next, doubled,
        # ejection ends early only once probes have seen it down and up again.
        if ejected and (st.probe_failed_while_ejected or not st.readmitted_by_probe):
            readmit_by_probe = not st.probe_failed_while_ejected
            self._end_ejection(name, st, now, "probe")
            st.readmitted_by_probe = readmit_by_probe

    def out_of_rotation(self, name: str) -> bool:
        """Ejected or failing probes: probed every `unhealthy_interval` (a read, no change)."""
        st = self._state.get(name)
        return st is not None and (st.probe_failed or st.ejected_until > self._clock())

    # -- reporting --------------------------------------------------------------------------

    def describe(self, name: str) -> dict[str, Any]:
        st = self._state.get(name) or BackendHealth()
        now = self._clock()
        wall = self._wall()
        ejected = st.ejected_until > now
        cooling = st.cooldown_until > now
        if st.probe_failed:
            reason: str | None = f"probe failed ({st.probe_reason})"
        elif ejected:
            reason = f"ejected: {st.eject_reason}"
        elif cooling:
            reason = "cooling down (Retry-After)"
        else:
            reason = None
        return {
            "healthy": not (st.probe_failed or ejected or cooling),
            "ejected_until": round(wall + st.ejected_until - now, 3) if ejected else None,
            "cooldown_until": round(wall + st.cooldown_until - now, 3) if cooling else None,
            "reason": reason,
            "consecutive_failures": st.consecutive_failures,
            "times_ejected": st.times_ejected,
            "last_error": st.last_error,
            "last_probe_latency_ms": st.last_probe_latency_ms,
        }

    def _transition(self, event: str, backend: str | None, **fields: Any) -> None:
        _log_transition(event, backend, **fields)
        if backend is None or self._on_change is None:
            return
        if event in _RECOVERIES:
            self._on_change(backend, bool(self.describe(backend)["healthy"]), event)
        elif event in _LOSSES:
            reason = _LOSSES[event] or f"outlier_{fields.get('reason', 'failure')}"
            self._on_change(backend, False, reason)


_RECOVERIES = frozenset({"healthy", "ejection over", "cooldown over", "panic mode over"})


_LOSSES = {"ejected": "", "unhealthy": "probe", "cooling down": "retry_after"}


def _log_transition(event: str, backend: str | None, **fields: Any) -> None:
    level = logging.INFO if event in _RECOVERIES else logging.WARNING
    log.log(level, event, extra={"fields": {"event": event, "backend": backend, **fields}})
