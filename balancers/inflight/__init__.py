"""In-flight stores: `local` (in-process, default) and `redis` (shared by every replica)."""

from balancers.inflight.base import InflightStore, Lease
from balancers.inflight.local import LocalInflight

__all__ = ["InflightStore", "Lease", "LocalInflight"]
