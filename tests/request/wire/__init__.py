"""Tests of router/request/wire/: multipart forms and the bodies held."""
