"""A discovery change costs its own size, not the fleet's (issue 31, case 2), counted, not timed.

The reconciler and the Fleet run in process with a registry whose consumers (health, probes,
scrapes, KV events in the app) are stand-ins that count what they are handed: a whole
snapshot on a swap, the change alone on a patch. Filling 10,000 endpoints slice by slice must
hand each backend over once and publish a bounded number of snapshots per slice; one
endpoint's change must hand over one backend; a slice replaced, that slice. The code before
issue 31 rebuilt the whole snapshot once per name (`Fleet._compose` in a loop), and every
change handed the consumers the whole fleet: these counts were quadratic there. The timings
are the benchmark's (`python -m bench.oneoff.discovery --only large|app`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from router.core.settings import KubernetesDiscovery
from router.discovery.reconcile import Endpoint, Reconciler
from router.registry.fleet import Change, Fleet, LocalRecords, Registry, Snapshot

SLICES = 20
PER_SLICE = 500
N = SLICES * PER_SLICE


class Consumers:
    """What the registry's on_change hands the app's followers (health, probes, scrapes, KV
    events): the whole set on a swap, the change alone on a patch."""

    def __init__(self) -> None:
        self.snapshots = 0
        self.handed = 0  # backends (or removed names) handed over, in all

    def on_change(self, snap: Snapshot, change: Change | None) -> None:
        self.snapshots += 1
        if change is None:
            self.handed += len(snap.backends)
        else:
            self.handed += len(change.upserted) + len(change.removed)

    def reset(self) -> tuple[int, int]:
        seen = (self.snapshots, self.handed)
        self.snapshots = self.handed = 0
        return seen


class Quiet:
    def discovery_event(self, source: str, event: str, n: int = 1) -> None:
        return None


async def no_streams(names: Sequence[str]) -> dict[str, int]:
    return {}


def address(i: int) -> str:
    return f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"


def endpoints(first: int, count: int, ready: bool = True) -> list[Endpoint]:
    return [Endpoint(address(i), 8000, ready) for i in range(first, first + count)]


def test_discovery_work_grows_with_the_change_not_with_the_fleet() -> None:
    seen = Consumers()
    registry = Registry([], "least_inflight", on_change=seen.on_change)
    fleet = Fleet(registry, [], LocalRecords())
    cfg = KubernetesDiscovery.model_validate(
        {
            "kind": "kubernetes",
            "namespace": "m",
            "service": "vllm",
            "port": 8000,
            "models": ["m"],
            "max_endpoints": N + 10,
        }
    )

    async def run() -> None:
        rec = Reconciler("k", cfg, fleet, no_streams, Quiet(), 30)
        seen.reset()
        for s in range(SLICES):  # one watch event per slice
            await rec.update_group(f"s{s}", endpoints(s * PER_SLICE, PER_SLICE))
        snapshots, handed = seen.reset()
        assert len(registry.snapshot.backends) == N
        assert handed == N, "each backend is handed over once, whatever the fleet's size"
        assert SLICES <= snapshots <= 2 * SLICES

        # One endpoint of slice 0 drains (terminating): one backend, one snapshot.
        changed = endpoints(0, PER_SLICE)
        changed[7] = Endpoint(changed[7].host, 8000, False)
        await rec.update_group("s0", changed)
        assert seen.reset() == (1, 1)
        assert registry.snapshot.by_name[f"vllm-{address(7)}-8000"].draining

        # One endpoint joins slice 3.
        grown = endpoints(3 * PER_SLICE, PER_SLICE) + endpoints(N + 50, 1)
        await rec.update_group("s3", grown)
        assert seen.reset() == (1, 1)

        # Slice 5 rolled out: its endpoints all replaced by new ones.
        await rec.update_group("s5", endpoints(N + 100, PER_SLICE))
        snapshots, handed = seen.reset()
        assert handed == 2 * PER_SLICE  # the old ones removed, the new ones added
        assert snapshots <= 2

        # A re-list that finds one slice gone and the others as they were.
        now = {f"s{s}": endpoints(s * PER_SLICE, PER_SLICE) for s in range(1, SLICES)}
        now["s0"] = changed
        now["s3"] = grown
        now["s5"] = endpoints(N + 100, PER_SLICE)
        del now["s9"]
        await rec.replace(now)
        snapshots, handed = seen.reset()
        assert handed == PER_SLICE
        assert snapshots <= 2
        assert len(registry.snapshot.backends) == N + 1 - PER_SLICE

    asyncio.run(run())
