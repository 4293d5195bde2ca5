"""Knowing which backends can take traffic: probes, passive outlier detection, cooldowns."""
