"""Tests of router/web/: the API routes, client keys, edge limits, admin, the console."""
