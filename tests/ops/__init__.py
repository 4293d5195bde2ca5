"""Tests of router/ops/: metrics, logs, tracing, the collector, the live ring."""
