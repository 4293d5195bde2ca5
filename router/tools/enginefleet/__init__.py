"""A fleet of real vLLM engines on this machine, for the engine test tier and for trying
sluicegate without a GPU (`sluicegate engines`): the engines' venv, a tiny model written locally,
and the engine processes. Not on the request path; nothing here is imported by the router.
"""
