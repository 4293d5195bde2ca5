"""Tests of router/request/migration/ (and the lifecycle's migrate step)."""
