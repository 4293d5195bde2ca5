"""Knowing which backends can take traffic: probes, passive outlier detection, cooldowns.

state.py     per-backend flags (probe, ejection, cooldown), thresholds, panic mode; the proxy's
             `eligible()` filter and the admin view
probes.py    one active probe (GET /health or /v1/models)
monitor.py   background scheduling of probes (jittered interval, bounded concurrency)
outlier.py   passive detection policy: ejection backoff, cap, max share of a model's backends
"""
