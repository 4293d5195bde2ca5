"""A vLLM-like mock engine for tests, demos and benchmarks (`sluicegate mock-upstream`).

Not on the request path.
"""
