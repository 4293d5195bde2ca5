"""Tests of router/registry/: the backend set and its Redis sync."""
