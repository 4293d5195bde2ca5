"""Tests of router/request/lifecycle/: the steps, failover, disconnects, drain."""
