"""Tests of router/request/, one folder per room."""
