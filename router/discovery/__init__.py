"""Discovery: backends that follow the fleet (Kubernetes EndpointSlices, an InferencePool's pods,
DNS answers).

reconcile.py      Endpoint sets -> discovered backends (drain, removal after streams end)
watch.py          list + watch one kind of Kubernetes object (kubernetes-asyncio), re-list every
                  `resync`: the loop the two Kubernetes sources share
kubernetes.py     EndpointSlices of a Service
inferencepool.py  an InferencePool (inference.networking.k8s.io/v1) and the pods it selects
dns.py            re-resolve A/AAAA records every `interval` (dnspython)
runner.py         builds the configured sources, runs them, reports staleness
"""
