"""Tests of router/request/admit/: admission, quotas, the estimate, hops, limits."""
