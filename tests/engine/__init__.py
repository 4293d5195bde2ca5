"""Tests of router/engine/: engine readings, KV-cache events, LoRA adapters."""
