"""A broken stream continued elsewhere: what an attempt relayed, the continuation request, its
events joined to the stream, and which calls may migrate.
"""
