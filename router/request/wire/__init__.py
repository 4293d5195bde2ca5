"""Bytes in and out: server-sent events, hop-by-hop headers, multipart forms (pure)."""
