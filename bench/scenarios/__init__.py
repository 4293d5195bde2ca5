"""The scenarios of `make bench` (`python -m bench.run --only NAME`), registered in registry.py."""
