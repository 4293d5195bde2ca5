"""The request path: validation, the lifecycle (pick -> acquire -> stream -> release),
retries and failover.
"""
