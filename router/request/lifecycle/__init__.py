"""The request's steps, side by side, and their order (`proxy.py`): getting in, each attempt
(pick, lease, upstream), the prefill leg, the stream pump, migration, the accounting at the end.
Each step gives back what it took.
"""
