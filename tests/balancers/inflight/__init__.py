"""Tests of balancers/inflight/: the in-flight stores, local and shared."""
