"""Talking to backends: the HTTP/1.1 transport and one connection pool per backend."""
