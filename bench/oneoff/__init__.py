"""Investigations outside `make bench`'s scenarios, each run on its own
(`python -m bench.oneoff.NAME`): A/B costs of one feature, profiles, stress cases."""
