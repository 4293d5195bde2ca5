"""Getting in: validation, the token estimate, the admission queue, the client keys' quotas
(local and shared), the hop marker, the body budget.
"""
