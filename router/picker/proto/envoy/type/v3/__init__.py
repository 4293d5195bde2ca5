"""Generated from the vendored .proto files (router/tools/protos.py)."""
