"""The registry's rules for file entries and admin records (docs/admin.md), on the real
Fleet/Registry with in-process records; the drain deadline with an injected clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.core.backend import Backend
from router.core.settings import BackendConfig
from router.registry.fleet import Conflict, Fleet, Invalid, LocalRecords, NotFound, Registry


def cfg(name: str, **extra: Any) -> BackendConfig:
    data: dict[str, Any] = {"name": name, "url": f"http://{name}.test:8000", "models": ["m"]}
    return BackendConfig.model_validate({**data, **extra})


def fleet(*file: BackendConfig, store: LocalRecords | None = None) -> Fleet:
    registry = Registry([Backend.from_config(c) for c in file], "round_robin")
    return Fleet(registry, list(file), store or LocalRecords())


def names(f: Fleet) -> list[str]:
    return [b.name for b in f.registry.snapshot.backends]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_api_entries_join_file_entries_and_names_are_unique() -> None:
    f = fleet(cfg("a"))
    b = run(f.register(cfg("b", models={"pub": "own-id"})))
    assert b.source == "api" and names(f) == ["a", "b"]
    assert f.registry.snapshot.by_model["pub"][0].models["pub"] == "own-id"
    for name in ("a", "b"):
        with pytest.raises(Conflict):
            run(f.register(cfg(name)))


def test_a_patch_of_a_file_entry_keeps_later_file_edits() -> None:
    store = LocalRecords()
    f = fleet(cfg("a", weight=1), store=store)
    run(f.update("a", {"weight": 4}))
    assert run(store.load()) == {"a": {"patch": {"weight": 4.0}}}
    assert f.registry.snapshot.by_name["a"].weight == 4.0
    # The file changes the URL at the next start; the stored weight still applies.
    again = fleet(cfg("a", url="http://moved.test:9000"), store=store)
    again.apply(run(store.load()))
    a = again.registry.snapshot.by_name["a"]
    assert (a.url, a.weight, a.source) == ("http://moved.test:9000", 4.0, "file")


def test_deleting_a_file_entry_leaves_a_tombstone_until_posted_again() -> None:
    store = LocalRecords()
    f = fleet(cfg("a"), cfg("b"), store=store)
    result = run(f.remove("b", _zero, grace=1))
    assert result["in_flight_at_removal"] == 0 and names(f) == ["a"]
    restarted = fleet(cfg("a"), cfg("b"), store=store)
    restarted.apply(run(store.load()))
    assert names(restarted) == ["a"]
    with pytest.raises(NotFound):
        run(restarted.update("b", {"weight": 2}))
    run(restarted.register(cfg("b", weight=3)))
    assert restarted.registry.snapshot.by_name["b"].source == "api"


def test_an_api_entry_wins_over_a_file_entry_added_later() -> None:
    store = LocalRecords()
    f = fleet(cfg("a"), store=store)
    run(f.register(cfg("x", url="http://api.test:1")))
    later = fleet(cfg("a"), cfg("x", url="http://file.test:2"), store=store)
    later.apply(run(store.load()))
    x = later.registry.snapshot.by_name["x"]
    assert (x.url, x.source) == ("http://api.test:1", "api")
    assert names(later).count("x") == 1


def test_a_stored_patch_that_no_longer_fits_yields_to_the_file() -> None:
    store = LocalRecords()
    f = fleet(cfg("a", models={"m": "m", "n": "n"}), store=store)
    run(f.update("a", {"models": {"n": "n"}}))
    assert f.registry.snapshot.models == ("n",)
    # A record written by a newer or buggy replica that no longer validates over the file entry.
    run(store.change("a", lambda rec: {**(rec or {}), "patch": {"weight": -5}}))
    f.apply(run(store.load()))
    assert f.registry.snapshot.by_name["a"].weight == 1.0
    assert f.registry.snapshot.models == ("m", "n")


def test_patch_validation_names_the_field_and_changes_nothing() -> None:
    f = fleet(cfg("a"))
    version = f.registry.snapshot.version
    for changes, field in (
        ({"url": "http://x.test"}, "url"),
        ({"weight": "heavy"}, "weight"),
        ({"draining": 1}, "draining"),
        ({"models": {"": "x"}}, "models"),
    ):
        with pytest.raises(Invalid) as info:
            run(f.update("a", changes))
        assert str(info.value).startswith(field)
    assert f.registry.snapshot.version == version


def test_the_snapshot_is_swapped_whole_and_old_ones_stay_intact() -> None:
    f = fleet(cfg("a"))
    before = f.registry.snapshot
    run(f.update("a", {"draining": True}))
    after = f.registry.snapshot
    assert after is not before and after.version > before.version
    assert before.by_name["a"].draining is False and after.by_name["a"].draining is True
    # Applying the same records again does not churn the snapshot.
    f.apply(run(f.store.load()))
    assert f.registry.snapshot is after


def test_a_models_backends_by_name_follow_its_snapshot_and_adapter_routes() -> None:
    """`serving(model)`: the backends of `by_model[model]` by name, for the snapshot asked
    (a request keeps its own), an adapter's those of its base model."""
    a = Backend.from_config(cfg("a", kind="vllm"))
    b = Backend.from_config(cfg("b", models=["other"]))
    registry = Registry([a, b], "round_robin")
    registry.set_adapters({"sql": "m"})
    before = registry.snapshot
    assert dict(before.serving("m")) == {"a": a}
    assert dict(before.serving("sql")) == {"a": a}  # routed by its base model
    assert dict(before.serving("other")) == {"b": b}
    assert before.serving("unknown") == {}
    a2 = Backend.from_config(cfg("a", kind="vllm", weight=2))
    c = Backend.from_config(cfg("c"))
    after = registry.patch([a2, c], ["b"])
    assert dict(after.serving("m")) == {"a": a2, "c": c}
    assert dict(after.serving("sql")) == {"a": a2, "c": c}
    assert after.serving("other") == {}
    assert dict(before.serving("m")) == {"a": a}  # the old snapshot's view is its own
    for snap in (before, after):
        for model, backends in snap.by_model.items():
            assert list(snap.serving(model).values()) == list(backends)


def test_delete_waits_for_streams_until_the_grace_runs_out() -> None:
    now = [0.0]
    calls: list[float] = []

    async def busy() -> int:
        calls.append(now[0])
        now[0] += 10.0  # each look at the count advances the injected clock 10 s
        return 2

    registry = Registry([Backend.from_config(cfg("a"))], "round_robin")
    f = Fleet(registry, [cfg("a")], LocalRecords(), clock=lambda: now[0])
    result = run(f.remove("a", busy, grace=25))
    assert result == {"name": "a", "deleted": True, "in_flight_at_removal": 2}
    assert calls == [0.0, 10.0, 20.0]
    assert names(f) == []


async def _zero() -> int:
    return 0
