"""Tests of router/core/: settings, errors, validation, the network policy, the runner."""
