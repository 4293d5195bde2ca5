"""Tests of router/request/usage/: usage from the bytes, its strip, the book."""
