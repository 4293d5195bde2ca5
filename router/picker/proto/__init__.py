"""Envoy's ext_proc protocol: trimmed .proto copies and the Python generated from them."""
