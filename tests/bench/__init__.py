"""Tests of bench/: the benchmark's report."""
