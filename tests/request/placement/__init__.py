"""Tests of router/request/placement/: affinity, tokens, response ids, P/D."""
