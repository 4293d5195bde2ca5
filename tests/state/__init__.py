"""Tests of router/state/: the shared-store base, and Redis that survives a node loss."""
