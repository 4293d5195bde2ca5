"""Test doubles and tools beside the router, imported by the CLI only, never by a serving
module: the mock engine, the fleet of real vLLM engines, `sluicegate status`, the image's
health probe and the settings reference's writer.
"""
