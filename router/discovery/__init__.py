"""Discovery: backends that follow the fleet (Kubernetes EndpointSlices, DNS answers).

reconcile.py   Endpoint sets -> discovered backends (drain, removal after streams end)
kubernetes.py  list + watch EndpointSlices (kubernetes-asyncio), re-list every `resync`
dns.py         re-resolve A/AAAA records every `interval` (dnspython)
runner.py      builds the configured sources, runs them, reports staleness
"""
