"""Envoy's ext_proc protocol: the Python router/tools/protos.py generates from xds-protos'
descriptors of Envoy's API (Apache-2.0), trimmed to the messages the stream carries."""
