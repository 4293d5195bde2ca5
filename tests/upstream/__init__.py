"""Tests of router/upstream/: the transport, pools and TLS to backends."""
