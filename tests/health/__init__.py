"""Tests of health/: the health state, probes and recovery."""
