"""Tests of router/tools/: status, the engine fleet, the settings reference."""
