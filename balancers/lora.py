"""LoRA adapter affinity: which engines may take a request for an adapter, and what each costs.

A request for an adapter reaches the balancer as an `AdapterWant` in `PickContext.adapter` (its
name, and whether it may be loaded on demand); each candidate's engine reading says which
adapters it serves (its `/v1/models`), runs and queues (`vllm:lora_requests_info`) and how many
it runs at once (`max_lora`). Each candidate gets a tier, best first:

  RUNNING  the adapter has requests in the engine's running batch: a new one joins it for free
  SLOT     the engine serves it and has a free LoRA slot (fewer adapters running than max_lora)
  WAITING  it only waits there, or every slot runs other adapters: it waits for a slot to free
  LOAD     no candidate serves it, and it may be loaded on demand: the engine must load it first

vLLM 0.32 lists every adapter with requests, running or only waiting, under both labels (it
fills both from one dict). An adapter listed under both therefore counts as RUNNING only while
the engine lists no more adapters than it has slots; past that, some of them only wait, and
each one listed counts as WAITING. Taking a starving adapter for a running one would keep
feeding the queue that starves it.

An engine that does not serve the adapter is never a candidate while another one serves it, and
never at all without load on demand (`eligible()`); among LOAD candidates the one with the most
free slots comes first. The tier enters the balancers' costs as queue positions ahead of the
request (`AHEAD`): least_load adds QUEUE_WEIGHT x AHEAD[tier] to its score (in requests),
cache_aware adds AHEAD[tier] to the requests it counts ahead (its `ahead` term):

  RUNNING 0    SLOT 0.25    WAITING 1    LOAD 4 (+ 0.25 per slot in use)
  plus HOME x h(adapter, engine), h a rendezvous hash in [0, 1)

The adapters active on an engine are those its reading lists plus those this router has
requests in flight for there (`AdapterWant.flights`: exact, and no scrape behind).
The home term gives each adapter a stable order of engines, so its traffic concentrates on the
first ones until load outweighs up to HOME queue positions. With more adapters than slots,
every engine lists more adapters than it runs and the tiers alone no longer tell engines apart;
the adapters would then drift from engine to engine and each move costs a slot load.

so an engine running the adapter wins over one with a free slot unless it is about one queued
request busier, and a slot is taken over waiting unless the slot's engine is four requests
busier. Pure: no I/O, no clock; `failed` (engines whose load of this adapter failed recently)
arrives as data too.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from functools import lru_cache
from hashlib import blake2b

from balancers.base import Candidate, Choice
from balancers.context import AdapterWant
from router.core.engine import EngineReading


class Tier(IntEnum):
    RUNNING = 0
    SLOT = 1
    WAITING = 2
    LOAD = 3


AHEAD = {Tier.RUNNING: 0.0, Tier.SLOT: 0.25, Tier.WAITING: 1.0, Tier.LOAD: 4.0}
SLOT_IN_USE = 0.25  # LOAD: per adapter already running there (the most room goes first)
# Queue positions between an adapter's first and last engine in its home order. 6 (least_load:
# up to 24 requests, or 6 waiting ones): on `bench.run --only lora` (4 engines, 2 slots, 12
# adapters) it served 1.28-1.33x the requests of least_load at TTFT p90 0.65-0.70x and 0.65-0.69x
# the slot loads (two quiet runs), where 1 gave 1.06x, 0.93x and 0.91x, and 12 gave 1.54x, 0.57x,
# 0.49x (one run each); past 6 an adapter's traffic piles on one engine, 12 waiting requests deep,
# before it spreads.
HOME = 6.0
REASONS = {
    Tier.RUNNING: "adapter_running",
    Tier.SLOT: "adapter_slot",
    Tier.WAITING: "adapter_waiting",
    Tier.LOAD: "adapter_load",
}


def serves(r: EngineReading | None, want: AdapterWant, name: str) -> bool:
    if name in want.loaded:
        return True
    return r is not None and r.serves(want.name) and name not in want.unloaded


def tier(r: EngineReading | None, want: AdapterWant, name: str) -> Tier:
    if not serves(r, want, name):
        return Tier.LOAD
    ours = want.flights.get(name)
    running = r.lora_running if r is not None else frozenset()
    active = running | ours if ours else running
    cap = r.max_lora if r is not None else None
    over = cap is not None and len(active) > cap
    if want.name in active:
        # Listed under both labels (vLLM 0.32) on an engine with more adapters than slots:
        # it may only wait there.
        if not over or (r is not None and want.name not in r.lora_waiting and not ours):
            return Tier.RUNNING
        return Tier.WAITING
    if r is not None and want.name in r.lora_waiting:
        return Tier.WAITING
    if cap is not None and len(active) >= cap:
        return Tier.WAITING
    return Tier.SLOT


@lru_cache(maxsize=65536)
def home(adapter: str, engine: str) -> float:
    """The rendezvous hash of (adapter, engine), in [0, 1): the adapter's engine order."""
    digest = blake2b(f"{adapter}\x00{engine}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def ahead(c: Candidate, want: AdapterWant) -> float:
    """Queue positions the adapter costs on `c` (module docstring)."""
    r = c.engine
    t = tier(r, want, c.name)
    extra = AHEAD[t] + HOME * home(want.name, c.name)
    if t is Tier.LOAD and r is not None:
        extra += SLOT_IN_USE * len(r.lora_running)
    return extra


def loadable(r: EngineReading | None) -> bool:
    """The engine runs LoRA (it reports max_lora): an adapter can be loaded there."""
    return r is not None and r.max_lora is not None and r.max_lora > 0 and not r.stale


def eligible(candidates: Sequence[Candidate], want: AdapterWant) -> list[Candidate]:
    """Those serving the adapter; with none, those it may be loaded on (with load on demand)."""
    held = [c for c in candidates if serves(c.engine, want, c.name)]
    if held or not want.on_demand:
        return held
    return [c for c in candidates if loadable(c.engine) and c.name not in want.failed]


def labelled(choice: Choice | None, want: AdapterWant) -> Choice | None:
    """A choice made among `eligible()` candidates by a policy that does not weigh adapters
    (round robin, least in flight, a plugin), with its adapter tier's reason."""
    if choice is None:
        return None
    c = choice.candidate
    return Choice(c, REASONS[tier(c.engine, want, c.name)], choice.held, choice.cached)
